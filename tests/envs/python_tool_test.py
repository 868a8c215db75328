"""The python_tool environment: math records from the tasks, sandboxed calls, scored answers."""

import asyncio
import json
import os
import random

import pytest

from jaxrl.data import TaskConfig, make_task
from jaxrl.envs import EnvError, EpisodeLimits, PythonToolEnv, run_episode


def call(code, name="python"):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': {'code': code}})}\n</tool_call>"


def play(env, record, turns, limits=None, policy=None):
  if policy is None:
    turns = iter(turns)
    policy = lambda messages: next(turns)  # noqa: E731
  episode = asyncio.run(
    run_episode(env, record, policy, limits or EpisodeLimits(), name="python_tool")
  )
  return episode, episode.summary()


def solver(messages):
  """Computes the arithmetic task's expression with the tool, then answers what it printed."""
  last = messages[-1]
  if last["role"] == "tool":
    return f"The result is \\boxed{{{last['content'].strip()}}}."
  expression = messages[-1]["content"].split("=")[0].strip()
  return f"Let me compute it.\n{call(f'print({expression})')}"


def test_solves_arithmetic_records_with_the_tool():
  test = make_task(TaskConfig(name="arithmetic", num_digits=3)).records("test", 3)
  for record in test:
    episode, s = play(PythonToolEnv(cpu_s=2), record, None, policy=solver)
    assert (s.end_reason, s.reward, s.turns, s.tool_calls) == ("done", 1.0, 2, 1)
    assert episode.messages[0]["role"] == "system" and "python" in episode.messages[0]["content"]
    assert episode.messages[3] == {"role": "tool", "content": record["answer"], "name": "python"}


def test_wrong_answers_score_zero_and_math_verify_checks_forms():
  record = {"id": "h", "question": "What is one half?", "answer": "\\frac{1}{2}"}
  assert play(PythonToolEnv(), {**record, "answer": "0.5"}, ["\\boxed{0.5}"])[1].reward == 1.0
  assert play(PythonToolEnv(), {**record, "answer": "0.5"}, ["\\boxed{0.25}"])[1].reward == 0.0
  env = PythonToolEnv(answer_check="math_verify")
  assert play(env, record, ["It is \\boxed{0.5}"])[1].reward == 1.0


def test_malformed_calls_and_code_errors_are_reported_and_the_episode_goes_on():
  rng = random.Random(0)
  n = rng.randint(100, 999)
  record = {"id": "q", "prompt": f"What is {n} squared?", "answer": str(n * n)}
  turns = [
    '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>',
    call("print(1)", name="shell"),
    call("print(undefined_name)"),
    call(f"print({n} ** 2)"),
    f"\\boxed{{{n * n}}}",
  ]
  episode, s = play(PythonToolEnv(), record, turns)
  assert (s.end_reason, s.reward, s.turns, s.tool_calls) == ("done", 1.0, 5, 4)
  tool_replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
  assert tool_replies[0].startswith("Error: tool call 1 is not valid JSON")
  assert tool_replies[1] == "Error: there is no tool named 'shell'; the tools are: python."
  assert "NameError: name 'undefined_name' is not defined" in tool_replies[2]
  assert tool_replies[3] == f"{n * n}"


def test_a_hung_call_is_reported_or_ends_the_episode_with_its_reason():
  record = {"id": "loop", "question": "?", "answer": "1"}
  reported, s = play(PythonToolEnv(cpu_s=1), record, [call("while True: pass"), "\\boxed{1}"])
  assert s.end_reason == "done" and s.reward == 1.0
  assert reported.messages[3]["content"] == "[stopped: it used up its 1 s of CPU time]"
  limits = EpisodeLimits(failure_reward=-1.0)
  env = PythonToolEnv(timeout_s=0.5, end_episode_on=("timeout", "memory_limit"))
  _, s = play(env, record, [call("import time; time.sleep(30)")], limits)
  assert (s.end_reason, s.rewards, s.error) == (
    "tool_timeout",
    (-1.0,),
    "[stopped: it ran past the 0.5 s time limit]",
  )
  env = PythonToolEnv(memory_mb=200, end_episode_on=("memory_limit",))
  _, s = play(env, record, [call("x = bytearray(1 << 30)")], limits)
  assert s.end_reason == "tool_memory_limit" and "MemoryError" in s.error


def test_the_workdir_persists_across_calls_and_is_removed_at_the_end():
  env = PythonToolEnv()
  record = {"id": "w", "question": "?", "answer": "42"}
  turns = [
    call("import os\nopen('n.txt', 'w').write('41')\nprint(os.getcwd())"),
    call("print(int(open('n.txt').read()) + 1)"),
    "\\boxed{42}",
  ]
  episode, s = play(env, record, turns)
  workdir, answer = episode.messages[3]["content"], episode.messages[5]["content"]
  assert answer == "42" and s.reward == 1.0
  assert os.path.basename(workdir).startswith("jaxrl-python-tool-")
  assert not os.path.exists(workdir)


def test_reset_uses_the_records_messages_and_system_prompt():
  env = PythonToolEnv(system_prompt="Use the tool.")
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  assert env.reset({"messages": messages, "answer": "4"}) == [
    {"role": "system", "content": "Be brief.\n\nUse the tool."},
    {"role": "user", "content": "2+2?"},
  ]
  assert messages[0]["content"] == "Be brief."  # the record is not modified
  assert PythonToolEnv(system_prompt="").reset({"prompt": "2+2?", "answer": "4"}) == [
    {"role": "user", "content": "2+2?"}
  ]
  env.close()
  with pytest.raises(EnvError, match="has no 'answer'"):
    PythonToolEnv().reset({"id": "n", "question": "?"})
  with pytest.raises(EnvError, match="has none of 'messages', 'question', 'prompt'"):
    PythonToolEnv().reset({"id": "n", "answer": "1"})
  with pytest.raises(ValueError, match="answer_check"):
    PythonToolEnv(answer_check="exact")
