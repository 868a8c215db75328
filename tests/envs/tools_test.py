"""Tool schemas, tool-call parsing (Hermes/Qwen and Llama 3), and answering calls."""

import json
import random
import re
import time

import pytest

from jaxrl.envs import (
  EndEpisode,
  MalformedCall,
  Step,
  Tool,
  ToolCall,
  ToolEnvironment,
  ToolError,
  check_tool_schema,
  parse_tool_calls,
)
from jaxrl.envs.tools import call_tool, check_arguments

ADD = {
  "type": "object",
  "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
  "required": ["a", "b"],
}


def hermes(name, arguments):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_reads_several_calls_in_order_with_the_text_around_them():
  rng = random.Random(0)
  args = [{"a": rng.randint(-99, 99), "b": rng.random()} for _ in range(3)]
  text = (
    f"Let me add.\n{hermes('add', args[0])}\n{hermes('add', args[1])}then {hermes('x', args[2])}"
  )
  parsed = parse_tool_calls(text, "hermes")
  assert parsed.calls == tuple(
    ToolCall(n, a) for n, a in zip(["add", "add", "x"], args, strict=True)
  )
  assert parsed.content == "Let me add.\n\nthen"


def test_hermes_reads_a_last_call_left_open_when_its_json_is_complete():
  text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
  assert parse_tool_calls(text).calls == (ToolCall("add", {"a": 1, "b": 2}),)


def test_hermes_accepts_arguments_written_as_a_json_string_and_no_arguments():
  text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 3}"}</tool_call><tool_call>{"name": "g"}'
  assert parse_tool_calls(text).calls == (ToolCall("f", {"a": 3}), ToolCall("g", {}))


@pytest.mark.parametrize(
  "body, error",
  [
    ('{"name": "add", "arguments": {"a": 1,}}', "tool call 1 is not valid JSON"),
    ('{"name": "add", "arguments": {"a": 1', "tool call 1 is not closed with </tool_call>"),
    ('["add", 1]', "tool call 1 must be a JSON object"),
    ('{"arguments": {}}', 'tool call 1 has no "name" string'),
    (
      '{"name": "add", "arguments": [1, 2]}',
      'tool call 1 \\(add\\): "arguments" must be a JSON object',
    ),
  ],
)
def test_a_malformed_hermes_call_is_a_malformed_call_not_an_exception(body, error):
  close = "" if "not closed" in error else "</tool_call>"
  parsed = parse_tool_calls(f"thinking <tool_call>{body}{close} more", "hermes")
  (call,) = parsed.calls
  assert isinstance(call, MalformedCall)
  assert re.search(error, call.error), call.error


def test_llama3_reads_a_json_turn_and_python_tag_calls_separated_by_semicolons():
  one = '{"name": "add", "parameters": {"a": 1, "b": 2.5}}'
  assert parse_tool_calls(one, "llama3").calls == (ToolCall("add", {"a": 1, "b": 2.5}),)
  text = (
    'Sure.<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "arguments": {}}'
  )
  parsed = parse_tool_calls(text, "llama3")
  assert parsed.calls == (ToolCall("f", {"x": "y"}), ToolCall("g", {}))
  assert parsed.content == "Sure."


def test_llama3_text_without_json_is_an_answer_and_bad_json_is_malformed():
  assert parse_tool_calls("The answer is {x}? no: 42.", "llama3").calls == ()
  (call,) = parse_tool_calls("<|python_tag|>print(1)", "llama3").calls
  assert isinstance(call, MalformedCall) and "must be a JSON object" in call.error
  calls = parse_tool_calls('{"name": "f", "parameters": {}}; {"name": "g", "param', "llama3").calls
  assert calls[0] == ToolCall("f", {})
  assert isinstance(calls[1], MalformedCall) and "tool call 2 is not valid JSON" in calls[1].error


def test_parse_tool_calls_names_the_known_formats():
  with pytest.raises(
    ValueError, match=r"unknown tool-call format 'xml'; known: \['hermes', 'llama3'\]"
  ):
    parse_tool_calls("x", "xml")


def schema(name="add", parameters=None):
  return {
    "type": "function",
    "function": {"name": name, "description": "adds", "parameters": parameters or ADD},
  }


@pytest.mark.parametrize(
  "bad, message",
  [
    ({"type": "tool", "function": schema()["function"]}, "\"type\" is 'tool'"),
    (schema(name="9lives"), '"function.name" must be'),
    (schema(name="has space"), '"function.name" must be'),
    (schema(parameters={"type": "array"}), '"function.parameters" must be a JSON schema'),
    (
      schema(parameters={"type": "object", "properties": {"a": {"type": "int"}}}),
      "tool 'add': \"function.parameters.properties.a.type\" = 'int' is not one of",
    ),
    (
      schema(parameters={**ADD, "required": ["a", "c"]}),
      "\"function.parameters.required\" = \\['a', 'c'\\] must list names",
    ),
    (schema(parameters={**ADD, "default": float("nan")}), "not plain JSON"),
    (schema(parameters={**ADD, "default": object()}), "not plain JSON"),
  ],
)
def test_check_tool_schema_names_the_tool_and_the_field(bad, message):
  with pytest.raises(ValueError, match=message):
    check_tool_schema(bad)


def test_a_tool_checks_its_schema_when_made():
  with pytest.raises(ValueError, match="is not one of"):
    Tool("add", "adds", {"type": "object", "properties": {"a": {"type": "float"}}}, lambda a: a)
  assert Tool("add", "adds", ADD, lambda a, b: a + b).schema() == schema()


@pytest.mark.parametrize(
  "arguments, problem",
  [
    ({"a": 1}, "missing required argument(s) ['b']"),
    ({"a": 1, "b": 2, "c": 3}, "unknown argument(s) ['c']; the arguments are ['a', 'b']"),
    ({"a": 1.5, "b": 2}, "argument 'a' = 1.5 is not of type integer"),
    ({"a": True, "b": 2}, "argument 'a' = True is not of type integer"),
    ({"a": 1, "b": "2"}, "argument 'b' = '2' is not of type number"),
    ({"a": 1, "b": 2.5}, None),
  ],
)
def test_check_arguments(arguments, problem):
  assert check_arguments(ADD, arguments) == problem


def test_check_arguments_enum_and_additional_properties():
  params = {"type": "object", "properties": {"op": {"type": "string", "enum": ["+", "-"]}}}
  assert "is not one of ['+', '-']" in check_arguments(params, {"op": "*"})
  assert check_arguments({**params, "additionalProperties": True}, {"op": "+", "x": 1}) is None


def test_call_tool_answers_every_failure_with_a_message():
  def boom(a, b):
    raise ZeroDivisionError("nope")

  def slow(a, b):
    raise ToolError("timeout", "[stopped: too slow]")

  tools = {
    "add": Tool("add", "adds", ADD, lambda a, b: a + b),
    "boom": Tool("boom", "fails", ADD, boom),
    "slow": Tool("slow", "hangs", ADD, slow),
  }
  cases = [
    (ToolCall("add", {"a": 2, "b": 0.5}), "2.5", None),
    (
      ToolCall("sub", {}),
      "Error: there is no tool named 'sub'; the tools are: add, boom, slow.",
      "unknown_tool",
    ),
    (ToolCall("add", {"a": 2}), "Error: add: missing required argument(s) ['b'].", "bad_arguments"),
    (
      ToolCall("boom", {"a": 1, "b": 1}),
      "Error: boom raised ZeroDivisionError: nope",
      "tool_raised",
    ),
    (ToolCall("slow", {"a": 1, "b": 1}), "[stopped: too slow]", "timeout"),
    (
      MalformedCall("{", "tool call 1 is not valid JSON"),
      "Error: tool call 1 is not valid JSON",
      "malformed_call",
    ),
  ]
  for call, content, kind in cases:
    outcome = call_tool(tools, call)
    assert (outcome.message["role"], outcome.message["content"], outcome.error_kind) == (
      "tool",
      content,
      kind,
    )


class Calculator(ToolEnvironment):
  def __init__(self, **kwargs):
    super().__init__([Tool("add", "adds", ADD, lambda a, b: a + b)], **kwargs)

  def reset(self, record):
    self.answer_ = record["answer"]
    return [{"role": "user", "content": record["question"]}]

  def answer(self, text):
    return Step([], float(text.strip() == self.answer_), True)


def test_a_tool_environment_runs_calls_and_scores_a_turn_without_one():
  env = Calculator(max_calls_per_turn=2)
  env.reset({"question": "3 + 4?", "answer": "7"})
  calls = [
    hermes("add", {"a": 3, "b": 4}),
    "<tool_call>{bad</tool_call>",
    hermes("add", {"a": 1, "b": 1}),
  ]
  turn = " ".join(calls)
  step = env.step(turn)
  assert [m["content"] for m in step.messages] == [
    "7",
    "Error: tool call 2 is not valid JSON (Expecting property name enclosed in double quotes at "
    "line 1 column 2).",
    "Error: at most 2 tool calls per turn; this one was not run.",
  ]
  assert (step.reward, step.done, step.info["tool_calls"]) == (0.0, False, 3)
  assert [e["kind"] for e in step.info["tool_errors"]] == ["malformed_call", "too_many_calls"]
  assert env.step("7") == Step([], 1.0, True)
  assert env.tools == [schema()]


class SlowCalculator(Calculator):
  def __init__(self, **kwargs):
    def slow_add(a, b):
      time.sleep(0.3)
      return a + b

    ToolEnvironment.__init__(self, [Tool("add", "adds", ADD, slow_add)], **kwargs)


def test_no_call_starts_once_the_turn_has_spent_its_time():
  """Slow calls are reported to the model, not left to run into the episode's step timeout."""
  env = SlowCalculator(max_calls_per_turn=4, turn_time_s=0.5)
  env.reset({"question": "?", "answer": "2"})
  step = env.step(" ".join(hermes("add", {"a": 1, "b": i}) for i in range(4)))
  contents = [m["content"] for m in step.messages]
  assert contents[:2] == ["1", "2"]  # started at 0 s and 0.3 s; the third would at 0.6 s
  assert all("the most a turn may spend is 0.5 s; this one was not run" in c for c in contents[2:])
  assert [e["kind"] for e in step.info["tool_errors"]] == ["turn_time_spent"] * 2
  with pytest.raises(ValueError, match="turn_time_s"):
    Calculator(turn_time_s=0)


def test_a_tool_environment_can_end_the_episode_on_a_failure_kind():
  env = Calculator(end_episode_on=("malformed_call",))
  env.reset({"question": "?", "answer": "1"})
  with pytest.raises(EndEpisode) as info:
    env.step("<tool_call>{nope}</tool_call>")
  assert info.value.reason == "tool_malformed_call"
  assert "not valid JSON" in info.value.message


def test_a_tool_environment_checks_its_options():
  with pytest.raises(ValueError, match="tool_format 'xml'"):
    Calculator(tool_format="xml")
  with pytest.raises(ValueError, match="unique"):
    ToolEnvironment.__init__(Calculator(), [Tool("a", "", ADD, print), Tool("a", "", ADD, print)])
