"""The environment interface: `Environment`, `Step`, and the adapter that calls either kind.

An environment is made per trajectory. `reset(record)` turns a dataset record into the first
chat messages; `step(action)` takes the model's turn (its decoded text) and returns a `Step`.
Either method may be `async def`; `run_reset` and `run_step` await a coroutine method and run a
plain one in a thread, both under a timeout, so a caller never needs to know which it has.

What an environment returns is checked (`check_messages`, `check_step`): a wrong type is an
`EnvError` that names the environment and the field, e.g. `Step.messages[0]['content']`.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


class EnvError(ValueError):
  """An environment that cannot be made, or that broke its contract; the message names it."""


class StepTimeout(EnvError):
  """`reset` or `step` ran past its timeout."""


class EndEpisode(Exception):  # noqa: N818 -- a signal to end the episode, not an error of the caller
  """Raised by an environment's `step` to end the episode as a failure with a named reason.

  The episode ends with `info["end_reason"] = reason` and the failure reward of its limits,
  exactly like a step that timed out; `message` is recorded as `info["error"]`.
  """

  def __init__(self, reason: str, message: str = ""):
    if not reason or not isinstance(reason, str):
      raise ValueError(f"EndEpisode needs a reason (a non-empty str), got {reason!r}")
    super().__init__(f"{reason}: {message}" if message else reason)
    self.reason = reason
    self.message = message


@dataclasses.dataclass(frozen=True)
class Step:
  """What the environment answers to one model turn.

  Attributes:
    messages: the next chat messages (`{"role", "content"}`: tool output, feedback), rendered
      with the chat template and appended to the trajectory; empty when there is nothing to say.
    reward: this turn's reward; an episode's reward is the sum over its turns.
    done: the episode has ended (the answer was given, the game is over).
    info: anything to log. Keys read by `Episode`: `tool_calls` (int, tool calls made in this
      turn, counted against `max_tool_calls`) and, with `done`, `end_reason` (str, default
      "done").
  """

  messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  done: bool = False
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
  """Base class of every environment: subclass it and define `reset` and `step`.

  Both may be `async def` (an environment that waits on I/O, a remote service) or plain methods
  (run in a worker thread by `run_step`); a plain method must not rely on thread-local state.
  One instance serves one trajectory, from `reset` to the step that ends it, then `close`.

  Attributes:
    tools: JSON schemas of the tools the model may call (`{"type": "function", "function":
      {...}}`), passed to the chat template as `tools=`; empty for an environment without tools.
  """

  tools: Sequence[Mapping[str, Any]] = ()
  # How messages name the environment; "" for `module:Class` (a stand-in for one in a worker
  # process names the environment and the worker).
  name_in_messages: str = ""

  @abc.abstractmethod
  def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The first chat messages of the episode, from a dataset record."""

  @abc.abstractmethod
  def step(self, action: str) -> Step:
    """Takes the model's turn (decoded text, stop token excluded) and answers it."""

  def scripted_action(self, rng: np.random.Generator) -> str | None:
    """A turn a scripted policy takes in the current state, or None (the default: there is
    none). A supervised warm-up of a multi-turn run (`config.warmup`) trains on episodes played
    with it, rendered token for token as rollout renders them."""
    del rng
    return None

  def close(self) -> None:  # noqa: B027 -- a lifecycle hook whose default is to hold nothing
    """Releases what the environment holds (files, processes); called once, when it ends.

    A plain method, even in an async environment: it runs wherever the episode ends.
    """


def env_label(env: Any) -> str:
  """How messages name an environment instance: its `name_in_messages`, or `module:Class`."""
  if isinstance(env, Environment) and env.name_in_messages:
    return env.name_in_messages
  cls = type(env)
  return f"{cls.__module__}:{cls.__qualname__}"


async def run_reset(
  env: Environment,
  record: dict[str, Any],
  timeout_s: float | None,
  *,
  executor: concurrent.futures.Executor | None = None,
) -> Any:
  """Calls `env.reset(record)` (awaited, or in a thread) under a timeout; returns its result.

  Raises:
    StepTimeout: it took longer than `timeout_s` (a thread running a plain method cannot be
      stopped: it finishes in the background and its result is dropped).
    Exception: whatever the method raised.
  """
  return await _call(env.reset, record, timeout_s, executor, f"{env_label(env)}.reset()")


async def run_step(
  env: Environment,
  action: str,
  timeout_s: float | None,
  *,
  executor: concurrent.futures.Executor | None = None,
) -> Any:
  """Calls `env.step(action)` (awaited, or in a thread) under a timeout; returns its result.

  Args:
    env: the environment.
    action: the model's turn.
    timeout_s: seconds the step may take, None for no limit.
    executor: where a plain (non-async) `step` runs; None for the event loop's default thread
      pool. Give a pool of your own to run many steps at once (the default has min(32, cores +
      4) threads, and time spent queueing counts against the timeout), and where a plain step
      may hang: its thread cannot be stopped, and `asyncio.run` waits for the default pool's
      threads before it returns, while your own can be shut down with `wait=False`.

  Raises:
    StepTimeout: it took longer than `timeout_s`.
    Exception: whatever `step` raised.
  """
  return await _call(env.step, action, timeout_s, executor, f"{env_label(env)}.step()")


async def _call(
  fn: Callable[[Any], Any],
  arg: Any,
  timeout_s: float | None,
  executor: concurrent.futures.Executor | None,
  what: str,
) -> Any:
  async def call() -> Any:
    if inspect.iscoroutinefunction(fn):
      result = await fn(arg)
    else:
      result = await asyncio.get_running_loop().run_in_executor(executor, fn, arg)
    if inspect.isawaitable(result):  # a plain method that returned a coroutine
      result = await result
    return result

  # asyncio.timeout (not wait_for + except TimeoutError alone) so that a TimeoutError raised by
  # the environment itself stays its own error, not mistaken for ours.
  scope = asyncio.timeout(timeout_s)
  try:
    async with scope:
      return await call()
  except TimeoutError:
    if scope.expired():
      raise StepTimeout(f"{what} took longer than its timeout of {timeout_s:g} s") from None
    raise


# -- checks ------------------------------------------------------------------------------------


def check_messages(value: Any, where: str, *, allow_empty: bool) -> list[dict[str, Any]]:
  """A plain copy of chat messages, or `EnvError` naming the field that is wrong.

  Args:
    value: what the environment returned.
    where: how to name it in an error, e.g. "environment guess_number: step() returned
      Step.messages".
    allow_empty: whether an empty list is fine (a step may say nothing, a reset may not).
  """
  if not isinstance(value, list | tuple):
    raise EnvError(
      f"{where} = {value!r:.80} ({type(value).__name__}); expected a list of chat messages "
      '{"role": str, "content": str}.'
    )
  if not value and not allow_empty:
    raise EnvError(f"{where} is empty; an episode starts with at least one message.")
  out = []
  for i, message in enumerate(value):
    if not isinstance(message, Mapping):
      raise EnvError(
        f"{where}[{i}] = {message!r:.80} ({type(message).__name__}); expected a dict "
        '{"role": str, "content": str}.'
      )
    for key in ("role", "content"):
      if not isinstance(message.get(key), str):
        got = message.get(key)
        raise EnvError(
          f"{where}[{i}][{key!r}] = {got!r:.80} ({type(got).__name__}); expected a str."
        )
    if not message["role"]:
      raise EnvError(f"{where}[{i}]['role'] is empty.")
    out.append(dict(message))
  return out


def check_step(value: Any, where: str) -> Step:
  """A checked, normalised copy of a `Step`, or `EnvError` naming the field that is wrong.

  Args:
    value: what `step()` returned.
    where: how to name it, e.g. "environment guess_number: step() returned".
  """
  if not isinstance(value, Step):
    raise EnvError(
      f"{where} {value!r:.80} ({type(value).__name__}); expected "
      "jaxrl.envs.Step(messages, reward, done, info)."
    )
  messages = check_messages(value.messages, f"{where} Step.messages", allow_empty=True)
  reward = value.reward
  if isinstance(reward, bool | np.bool_) or not isinstance(reward, numbers.Real):
    raise EnvError(
      f"{where} Step.reward = {reward!r:.80} ({type(reward).__name__}); expected a float."
    )
  if not math.isfinite(reward):
    raise EnvError(f"{where} Step.reward = {reward!r}; expected a finite float.")
  if not isinstance(value.done, bool | np.bool_):
    raise EnvError(
      f"{where} Step.done = {value.done!r:.80} ({type(value.done).__name__}); expected a bool."
    )
  if not isinstance(value.info, Mapping):
    raise EnvError(
      f"{where} Step.info = {value.info!r:.80} ({type(value.info).__name__}); expected a dict."
    )
  info = dict(value.info)
  calls = info.get("tool_calls", 0)
  if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 0:
    raise EnvError(f"{where} Step.info['tool_calls'] = {calls!r:.80}; expected an int >= 0.")
  reason = info.get("end_reason")
  if reason is not None and not (isinstance(reason, str) and reason):
    raise EnvError(f"{where} Step.info['end_reason'] = {reason!r:.80}; expected a non-empty str.")
  return Step(messages, float(reward), bool(value.done), info)
