"""Tools: JSON-schema descriptions for the chat template, tool-call parsing, and `ToolEnvironment`.

A tool is described to the model by a JSON schema, `{"type": "function", "function": {"name",
"description", "parameters"}}`, the `tools=` argument of a chat template (Qwen3's lists them in
the system turn inside `<tools></tools>`, Llama 3.1's in its system or first user turn);
`HFTokenizer.apply_chat_template(messages, tools=env.tools)` renders them. `check_tool_schema`
checks one before a template sees it.

Tool calls are parsed from the model's text in the format its template taught it:
- "hermes" (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, several per turn allowed; a last call left unclosed (the model stopped at
  `</tool_call>`) is read if its JSON is complete.
- "llama3" (Llama 3.1-3.3 JSON tool calling): the turn is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>` (a special token, which decoding usually drops), several
  separated by ";".
A call that cannot be read is a `MalformedCall`, answered with an error message to the model as
a tool message; parsing never raises.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl.envs.base import EndEpisode, Environment, Step

TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
# JSON schema type names and the Python types json.loads gives for them.
JSON_TYPES: dict[str, tuple[type, ...]] = {
  "string": (str,),
  "integer": (int,),
  "number": (int, float),
  "boolean": (bool,),
  "array": (list,),
  "object": (dict,),
  "null": (type(None),),
}
# Kinds of tool failure (`ToolOutcome.error_kind`); a tool's own `ToolError` adds its kinds.
MALFORMED_CALL = "malformed_call"
UNKNOWN_TOOL = "unknown_tool"
BAD_ARGUMENTS = "bad_arguments"
TOOL_RAISED = "tool_raised"
TOO_MANY_CALLS = "too_many_calls"
TURN_TIME_SPENT = "turn_time_spent"


class ToolError(Exception):
  """Raised by a tool function for a failure of a known kind (e.g. "timeout", "memory_limit").

  The message goes to the model; `ToolEnvironment(end_episode_on=(kind, ...))` ends the episode
  on it instead, with end reason "tool_<kind>".
  """

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


def check_tool_schema(schema: Any) -> None:
  """Checks a tool's JSON schema as chat templates read it.

  Raises:
    ValueError: naming the tool and the field that is wrong.
  """
  if not isinstance(schema, Mapping):
    raise ValueError(f"a tool schema must be a dict, got {schema!r:.80}")
  fn = schema.get("function")
  name = fn.get("name") if isinstance(fn, Mapping) else None
  where = f"tool {name!r}" if isinstance(name, str) else "tool schema"
  if schema.get("type") != "function":
    raise ValueError(f'{where}: "type" is {schema.get("type")!r}; expected "function".')
  if not isinstance(fn, Mapping):
    raise ValueError(f'{where}: "function" is {fn!r:.80}; expected a dict with "name", ...')
  if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
    raise ValueError(
      f'{where}: "function.name" must be letters, digits, "_", "." or "-" (at most 64, not '
      f"starting with a digit), got {name!r}."
    )
  if not isinstance(fn.get("description", ""), str):
    raise ValueError(f'{where}: "function.description" must be a str.')
  params = fn.get("parameters", {"type": "object", "properties": {}})
  if not isinstance(params, Mapping) or params.get("type") != "object":
    raise ValueError(
      f'{where}: "function.parameters" must be a JSON schema {{"type": "object", '
      f'"properties": {{...}}}}, got {params!r:.80}.'
    )
  properties = params.get("properties", {})
  if not isinstance(properties, Mapping):
    raise ValueError(f'{where}: "function.parameters.properties" must be a dict.')
  for key, prop in properties.items():
    field = f'{where}: "function.parameters.properties.{key}'
    if not isinstance(prop, Mapping):
      raise ValueError(f'{field}" must be a JSON schema (a dict), got {prop!r:.80}.')
    types = prop.get("type", [])
    for t in [types] if isinstance(types, str) else types:
      if t not in JSON_TYPES:
        raise ValueError(f'{field}.type" = {t!r} is not one of {sorted(JSON_TYPES)}.')
  required = params.get("required", [])
  if not isinstance(required, list | tuple) or any(r not in properties for r in required):
    raise ValueError(
      f'{where}: "function.parameters.required" = {required!r} must list names of '
      f"properties ({sorted(properties)})."
    )
  try:
    json.dumps(schema, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: the schema is not plain JSON ({e}).") from e


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function the model may call.

  Attributes:
    name: what the model calls it by.
    description: what it does, for the model.
    parameters: JSON schema of its arguments, `{"type": "object", "properties": {...},
      "required": [...]}`.
    fn: called with the arguments as keywords; returns the text the model reads (anything else
      is passed through `str`). It may raise `ToolError` for a failure of a known kind.
  """

  name: str
  description: str
  parameters: Mapping[str, Any]
  fn: Callable[..., Any]

  def __post_init__(self):
    check_tool_schema(self.schema())

  def schema(self) -> dict[str, Any]:
    """The JSON schema that chat templates render."""
    return {
      "type": "function",
      "function": {
        "name": self.name,
        "description": self.description,
        "parameters": json.loads(json.dumps(self.parameters)),
      },
    }


# -- parsing ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A call read from the model's text."""

  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
  """A call that could not be read: `text` is what was there, `error` says why."""

  text: str
  error: str


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """A model turn split into its text and its tool calls, in the order written.

  Attributes:
    content: the text outside the tool calls, stripped.
    calls: the calls, `MalformedCall` where one could not be read.
  """

  content: str
  calls: tuple[ToolCall | MalformedCall, ...]


def _call_from_json(obj: Any, text: str, number: int, argument_keys: tuple[str, ...]):
  shape = f'{{"name": "<tool>", "{argument_keys[0]}": {{...}}}}'
  if not isinstance(obj, dict):
    return MalformedCall(text, f"tool call {number} must be a JSON object {shape}.")
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return MalformedCall(text, f'tool call {number} has no "name" string; expected {shape}.')
  key = next((k for k in argument_keys if k in obj), None)
  arguments = obj.get(key, {}) if key else {}
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    with contextlib.suppress(json.JSONDecodeError):
      arguments = json.loads(arguments)
  if not isinstance(arguments, dict):
    return MalformedCall(
      text, f'tool call {number} ({name}): "{key}" must be a JSON object, got {arguments!r:.80}.'
    )
  return ToolCall(name, arguments)


def _json_error(e: json.JSONDecodeError) -> str:
  return f"{e.msg} at line {e.lineno} column {e.colno}"


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
  """Reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls (Qwen, Hermes)."""
  calls: list[ToolCall | MalformedCall] = []
  content = []
  end = 0
  for number, match in enumerate(_HERMES.finditer(text), 1):
    content.append(text[end : match.start()])
    end = match.end()
    body, closed = match.group(1).strip(), bool(match.group(2))
    try:
      obj = json.loads(body)
    except json.JSONDecodeError as e:
      why = "is not closed with </tool_call>" if not closed else "is not valid JSON"
      calls.append(MalformedCall(body, f"tool call {number} {why} ({_json_error(e)})."))
      continue
    calls.append(_call_from_json(obj, body, number, ("arguments", "parameters")))
  content.append(text[end:])
  return ParsedTurn("".join(content).strip(), tuple(calls))


PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> ParsedTurn:
  """Reads Llama 3 JSON calls: `{"name": ..., "parameters": {...}}`, ";"-separated, the whole
  turn or after `<|python_tag|>`. A turn that does not start with "{" (and has no tag) is text."""
  if PYTHON_TAG in text:
    content, payload = text.split(PYTHON_TAG, 1)
  elif text.lstrip().startswith("{"):
    content, payload = "", text
  else:
    return ParsedTurn(text.strip(), ())
  payload = payload.strip()
  calls: list[ToolCall | MalformedCall] = []
  if not payload.startswith("{"):
    error = (
      f'tool call 1 must be a JSON object {{"name": "<tool>", "parameters": {{...}}}}; '
      f"got {payload[:40]!r}."
    )
    return ParsedTurn(content.strip(), (MalformedCall(payload, error),))
  decoder = json.JSONDecoder()
  i, number = 0, 0
  while i < len(payload):
    while i < len(payload) and (payload[i].isspace() or payload[i] == ";"):
      i += 1
    if i == len(payload):
      break
    number += 1
    try:
      obj, j = decoder.raw_decode(payload, i)
    except json.JSONDecodeError as e:
      calls.append(
        MalformedCall(payload[i:], f"tool call {number} is not valid JSON ({_json_error(e)}).")
      )
      break
    calls.append(_call_from_json(obj, payload[i:j], number, ("parameters", "arguments")))
    i = j
  return ParsedTurn(content.strip(), tuple(calls))


TOOL_CALL_FORMATS: dict[str, Callable[[str], ParsedTurn]] = {
  "hermes": parse_hermes,
  "llama3": parse_llama3,
}


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
  """Splits a model turn into text and tool calls in format `fmt` (a key of TOOL_CALL_FORMATS)."""
  try:
    parse = TOOL_CALL_FORMATS[fmt]
  except KeyError:
    raise ValueError(
      f"unknown tool-call format {fmt!r}; known: {sorted(TOOL_CALL_FORMATS)}"
    ) from None
  return parse(text)


# -- calling ----------------------------------------------------------------------------------


def check_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
  """What is wrong with `arguments` for a tool's `parameters` schema, or None.

  Checks what a call gets wrong in practice: missing required and unknown arguments, and the
  JSON type and `enum` of each argument (not a full JSON-schema validator).
  """
  properties = parameters.get("properties", {})
  missing = [k for k in parameters.get("required", []) if k not in arguments]
  if missing:
    return f"missing required argument(s) {missing}"
  unknown = [k for k in arguments if k not in properties]
  if unknown and parameters.get("additionalProperties", False) is False:
    return f"unknown argument(s) {unknown}; the arguments are {sorted(properties)}"
  for key, value in arguments.items():
    prop = properties.get(key, {})
    types = prop.get("type")
    if types is not None:
      names = [types] if isinstance(types, str) else list(types)
      ok = any(
        isinstance(value, JSON_TYPES[t])
        and not (t in ("integer", "number") and isinstance(value, bool))
        for t in names
      )
      if not ok:
        return f"argument {key!r} = {value!r:.60} is not of type {' or '.join(names)}"
    if "enum" in prop and value not in prop["enum"]:
      return f"argument {key!r} = {value!r:.60} is not one of {prop['enum']}"
  return None


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
  """The answer to one call: the tool message for the model, and the failure kind if it failed."""

  message: dict[str, Any]
  error_kind: str | None = None


def tool_message(content: str, name: str | None = None) -> dict[str, Any]:
  """A tool-role chat message (templates render it as the tool's response)."""
  return {"role": "tool", "content": content, **({"name": name} if name else {})}


def call_tool(tools: Mapping[str, Tool], call: ToolCall | MalformedCall) -> ToolOutcome:
  """Runs one call and answers it; every failure becomes an error message, never an exception."""
  if isinstance(call, MalformedCall):
    return ToolOutcome(tool_message(f"Error: {call.error}"), MALFORMED_CALL)
  tool = tools.get(call.name)
  if tool is None:
    known = ", ".join(sorted(tools)) or "none"
    text = f"Error: there is no tool named {call.name!r}; the tools are: {known}."
    return ToolOutcome(tool_message(text), UNKNOWN_TOOL)
  problem = check_arguments(tool.parameters, call.arguments)
  if problem:
    return ToolOutcome(tool_message(f"Error: {call.name}: {problem}.", call.name), BAD_ARGUMENTS)
  try:
    result = tool.fn(**call.arguments)
  except ToolError as e:
    return ToolOutcome(tool_message(str(e), call.name), e.kind)
  except Exception as e:
    text = f"Error: {call.name} raised {type(e).__name__}: {e}"
    return ToolOutcome(tool_message(text, call.name), TOOL_RAISED)
  return ToolOutcome(tool_message(result if isinstance(result, str) else str(result), call.name))


class ToolEnvironment(Environment):
  """An environment whose model turns may call tools; a turn without a tool call is the answer.

  `step` parses the turn (format `tool_format`); when it has calls, each is run (at most
  `max_calls_per_turn`, the rest answered with an error) and answered with a tool message, the
  reward is 0 and the episode goes on (`info["tool_calls"]` counts them, `info["tool_errors"]`
  lists the failures). When it has none, `answer(text)` scores it. A failure whose kind is in
  `end_episode_on` ends the episode instead (`EndEpisode("tool_<kind>")`, the failure reward).
  `turn_time_s`: no call starts once the turn's calls have taken this long (they are answered
  with an error): keep it plus one call's longest time under the episode's step timeout
  (`EpisodeLimits.step_timeout_s`), so that slow tools are reported to the model rather than
  ending the episode as a step timeout. None: no bound.

  Subclasses define `reset` and `answer`, and pass their tools to `__init__`.
  """

  def __init__(
    self,
    tools: Sequence[Tool],
    *,
    tool_format: str = "hermes",
    max_calls_per_turn: int = 4,
    end_episode_on: Sequence[str] = (),
    turn_time_s: float | None = None,
  ):
    if tool_format not in TOOL_CALL_FORMATS:
      raise ValueError(f"tool_format {tool_format!r} is not one of {sorted(TOOL_CALL_FORMATS)}")
    if max_calls_per_turn < 1:
      raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
      raise ValueError(f"tool names must be unique, got {names}")
    self._tools = {t.name: t for t in tools}
    self.tool_format = tool_format
    self.max_calls_per_turn = max_calls_per_turn
    self.end_episode_on = tuple(end_episode_on)
    if turn_time_s is not None and not turn_time_s > 0:
      raise ValueError(f"turn_time_s must be > 0 or None, got {turn_time_s}")
    self.turn_time_s = turn_time_s

  @property
  def tools(self) -> list[dict[str, Any]]:
    return [t.schema() for t in self._tools.values()]

  @abc.abstractmethod
  def answer(self, text: str) -> Step:
    """Scores a turn that made no tool call (usually the final answer; `done=True`)."""

  def step(self, action: str) -> Step:
    parsed = parse_tool_calls(action, self.tool_format)
    if not parsed.calls:
      return self.answer(action)
    messages, errors = [], []
    start = time.monotonic()
    for i, call in enumerate(parsed.calls):
      spent = time.monotonic() - start
      if i >= self.max_calls_per_turn:
        text = (
          f"Error: at most {self.max_calls_per_turn} tool calls per turn; this one was not run."
        )
        outcome = ToolOutcome(tool_message(text), TOO_MANY_CALLS)
      elif self.turn_time_s is not None and spent >= self.turn_time_s:
        text = (
          f"Error: this turn's tool calls took {spent:.0f} s, the most a turn may spend is "
          f"{self.turn_time_s:g} s; this one was not run."
        )
        outcome = ToolOutcome(tool_message(text), TURN_TIME_SPENT)
      else:
        outcome = call_tool(self._tools, call)
      if outcome.error_kind in self.end_episode_on:
        raise EndEpisode(f"tool_{outcome.error_kind}", outcome.message["content"])
      if outcome.error_kind is not None:
        errors.append({"kind": outcome.error_kind, "message": outcome.message["content"]})
      messages.append(outcome.message)
    return Step(messages, 0.0, False, {"tool_calls": len(parsed.calls), "tool_errors": errors})
