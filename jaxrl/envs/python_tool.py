"""`python_tool`: the model may run Python in a sandbox to solve a math word problem.

Records are those of the math tasks (`jaxrl.data.tasks`: arithmetic, gsm8k, math): an "answer"
and a "question" (else the "prompt"), or chat "messages". The model calls the `python` tool
(`{"code": ...}`) as often as it likes, within the episode's limits; each call runs in a fresh
interpreter in this episode's own directory (`jaxrl.envs.sandbox`), and the model reads what it
printed. A turn with no tool call is the final answer, scored 1 or 0: "numeric" compares its
last number (inside its last `\\boxed{}` if it has one) with the gold answer, as the gsm8k task
does; "math_verify" uses math-verify, as the math task does (in the step's thread: bounded by
the step timeout, not by a verifier process).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from jaxrl.data import gsm8k, verify
from jaxrl.envs.base import EnvError, Step
from jaxrl.envs.sandbox import SandboxLimits, run_python
from jaxrl.envs.tools import Tool, ToolEnvironment, ToolError

SYSTEM_PROMPT = (
  "You can run Python code with the `python` tool. Each call runs in a fresh Python process "
  "(files you write stay in its working directory); print what you need to see. There is no "
  "network. When you know the answer, reply without a tool call and put the final answer "
  "within \\boxed{}."
)
ANSWER_CHECKS = ("numeric", "math_verify")

_PARAMETERS = {
  "type": "object",
  "properties": {"code": {"type": "string", "description": "Python 3 source to run."}},
  "required": ["code"],
}


class PythonToolEnv(ToolEnvironment):
  """A math problem, a sandboxed Python tool, and a reward for the final answer.

  Args:
    timeout_s: wall-clock seconds per tool call.
    cpu_s: CPU seconds per tool call.
    memory_mb: address space per tool call, MiB.
    max_output_chars: characters of a call's output the model reads.
    answer_check: "numeric" or "math_verify" (see the module docstring).
    system_prompt: the instructions, first in the conversation (joined to the record's own
      system message if it has one); "" for none.
    tool_format: how the model writes tool calls ("hermes" for Qwen, "llama3").
    max_calls_per_turn: tool calls run per turn; the rest are answered with an error.
    turn_time_s: no call starts once the turn's calls have run this long (the rest are
      answered with an error); with `timeout_s`, 25 s at most a turn, under the episode's
      default step timeout of 30 s (`EpisodeLimits.step_timeout_s`): keep it so.
    end_episode_on: failure kinds that end the episode instead of being reported to the model,
      e.g. ("timeout", "memory_limit", "malformed_call").
  """

  def __init__(
    self,
    *,
    timeout_s: float = 10.0,
    cpu_s: float = 5.0,
    memory_mb: int = 512,
    max_output_chars: int = 2000,
    answer_check: str = "numeric",
    system_prompt: str = SYSTEM_PROMPT,
    tool_format: str = "hermes",
    max_calls_per_turn: int = 4,
    end_episode_on: Sequence[str] = (),
    turn_time_s: float = 15.0,
  ):
    if answer_check not in ANSWER_CHECKS:
      raise ValueError(f"answer_check {answer_check!r} is not one of {ANSWER_CHECKS}")
    self.limits = SandboxLimits(
      timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_chars=max_output_chars
    )
    self.answer_check = answer_check
    self.system_prompt = system_prompt
    python = Tool(
      "python", "Runs Python 3 code and returns what it prints.", _PARAMETERS, self._run
    )
    super().__init__(
      [python],
      tool_format=tool_format,
      max_calls_per_turn=max_calls_per_turn,
      end_episode_on=end_episode_on,
      turn_time_s=turn_time_s,
    )
    self._record: dict[str, Any] | None = None
    self._workdir: str | None = None

  def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    if "answer" not in record:
      raise EnvError(f"python_tool: record {record.get('id', '?')!r} has no 'answer' field")
    self._record = record
    self._workdir = tempfile.mkdtemp(prefix="jaxrl-python-tool-")
    if record.get("messages"):
      messages = [dict(m) for m in record["messages"]]
    else:
      question = record.get("question") or record.get("prompt")
      if not isinstance(question, str):
        raise EnvError(
          f"python_tool: record {record.get('id', '?')!r} has none of 'messages', 'question', "
          "'prompt'"
        )
      messages = [{"role": "user", "content": question}]
    if self.system_prompt:
      if messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{self.system_prompt}"
      else:
        messages.insert(0, {"role": "system", "content": self.system_prompt})
    return messages

  def answer(self, text: str) -> Step:
    gold = str(self._record["answer"])
    if self.answer_check == "math_verify":
      correct = verify.answer_is_correct(gold, text)
    else:
      answer = verify.answer_part(text)  # as gsm8k.reward would take it
      boxed = verify.last_boxed(answer)
      correct = gsm8k.reward(gold, boxed if boxed is not None else answer) == 1.0
    return Step([], float(correct), True, {"correct": bool(correct)})

  def close(self) -> None:
    if self._workdir is not None:
      shutil.rmtree(self._workdir, ignore_errors=True)
      self._workdir = None

  def _run(self, code: str) -> str:
    if self._workdir is None:
      raise RuntimeError("python_tool: reset() was not called")
    result = run_python(code, self.limits, self._workdir)
    text = result.text(self.limits)
    if result.status in ("timeout", "cpu_limit"):
      raise ToolError("timeout", text)
    if result.status == "memory_limit":
      raise ToolError("memory_limit", text)
    return text
