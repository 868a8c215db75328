"""One trajectory's run through its environment, with the limits that keep it bounded.

`Episode` wraps a fresh environment and is what the rollout engine will drive: `reset(record)`
gives the first messages, `step(action)` passes each model turn on and returns the `Step` to
act on. Whatever the environment does, `step` returns: a step that raises, returns the wrong
types or runs past `step_timeout_s` ends the episode with `info["end_reason"]` saying why and
the failure reward, and the turns so far are kept. Limits on turns and tool calls end it the
same way but keep the rewards the environment gave.

End reasons: "done" (or the environment's own `info["end_reason"]`), "max_turns",
"max_tool_calls", "step_timeout", "env_error" (raised or broke the `Step` contract), a reason
an environment raised with `EndEpisode` (tool environments use "tool_<kind>", e.g.
"tool_timeout"), and "max_tokens", which the engine sets when a trajectory runs out of tokens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from jaxrl.envs.base import (
  EndEpisode,
  EnvError,
  Environment,
  Step,
  StepTimeout,
  check_messages,
  check_step,
  env_label,
  run_reset,
  run_step,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Bounds on one episode.

  Attributes:
    max_turns: model turns; the episode ends after this many if the environment has not ended it.
    max_tool_calls: tool calls over the whole episode (each step's `info["tool_calls"]`); the
      step that goes past it ends the episode (its calls have run: a tool environment bounds
      calls per turn itself).
    step_timeout_s: seconds one `reset` or `step` may take.
    failure_reward: the reward of a step that failed (timed out, raised, broke the contract, or
      ended the episode with `EndEpisode`), in place of the reward it did not give.
  """

  max_turns: int = 8
  max_tool_calls: int = 16
  step_timeout_s: float = 30.0
  failure_reward: float = 0.0

  def __post_init__(self):
    for name in ("max_turns", "max_tool_calls"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EpisodeLimits.{name} must be an int >= 1, got {value!r}")
    if not self.step_timeout_s > 0:
      raise ValueError(f"EpisodeLimits.step_timeout_s must be > 0, got {self.step_timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class EpisodeSummary:
  """How an episode went, for metrics and logs.

  Attributes:
    record_id: the record's "id" ("" without one).
    end_reason: why it ended (see the module docstring); "" while it runs.
    turns: model turns taken.
    tool_calls: tool calls counted.
    rewards: the reward of each turn.
    reward: their sum, the episode's reward.
    error: what went wrong, for a failure; else None.
    truncated: a limit ended it, not the environment.
  """

  record_id: str
  end_reason: str
  turns: int
  tool_calls: int
  rewards: tuple[float, ...]
  reward: float
  error: str | None
  truncated: bool


class Episode:
  """Drives one environment through one trajectory under `EpisodeLimits`.

  Attributes:
    env: the environment (closed when the episode ends).
    name: how messages name it (its registry name, or `module:Class`).
    messages: the conversation so far: the first messages, then each action as an assistant
      message followed by the environment's messages. For logs: the engine keeps the tokens.
    done: the episode has ended.
  """

  def __init__(
    self,
    env: Environment,
    limits: EpisodeLimits,
    *,
    name: str | None = None,
    executor: concurrent.futures.Executor | None = None,
  ):
    self.env = env
    self.limits = limits
    self.name = name or env_label(env)
    self._executor = executor
    self.messages: list[dict[str, Any]] = []
    self.done = False
    self._record_id = ""
    self._rewards: list[float] = []
    self._tool_calls = 0
    self._end_reason = ""
    self._error: str | None = None
    self._closed = False

  @property
  def tools(self) -> list[dict[str, Any]]:
    """The environment's tool schemas, for the chat template's `tools=` (empty: no tools)."""
    return [dict(t) for t in self.env.tools]

  async def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The first messages for `record`.

    Raises:
      EnvError: the environment raised, timed out or returned something other than chat
        messages; the message names the environment and the record. There is no trajectory
        yet, so nothing is lost: the caller skips the record.
    """
    self._record_id = str(record.get("id", ""))
    where = f"environment {self.name} (record {self._record_id!r}): reset() returned"
    try:
      value = await run_reset(self.env, record, self.limits.step_timeout_s, executor=self._executor)
      first = check_messages(value, where, allow_empty=False)
    except EnvError as e:
      self._close()
      if where in str(e):
        raise
      raise EnvError(f"environment {self.name} (record {self._record_id!r}): {e}") from e
    except Exception as e:
      self._close()
      raise EnvError(
        f"environment {self.name} (record {self._record_id!r}): reset() raised "
        f"{type(e).__name__}: {e}"
      ) from e
    self.messages = list(first)
    return first

  async def step(self, action: str) -> Step:
    """Passes the model's turn to the environment; never raises for what the environment does.

    Returns:
      The environment's `Step`, with `done` set and `info["end_reason"]` recorded when the
      episode ends; for a failure, no messages, the failure reward and `info["error"]`.

    Raises:
      RuntimeError: the episode has already ended, or was never reset.
    """
    if self.done:
      raise RuntimeError(f"episode of {self.name} has ended ({self._end_reason}); make a new one")
    if not self.messages:
      raise RuntimeError(f"episode of {self.name}: call reset(record) before step(action)")
    self.messages.append({"role": "assistant", "content": action})
    where = f"environment {self.name}: step() returned"
    try:
      value = await run_step(self.env, action, self.limits.step_timeout_s, executor=self._executor)
      step = check_step(value, where)
    except StepTimeout as e:
      return self._fail("step_timeout", str(e))
    except EndEpisode as e:
      return self._fail(e.reason, e.message or e.reason, level=logging.INFO)
    except EnvError as e:
      return self._fail("env_error", str(e))
    except Exception as e:
      tb = traceback.format_exc(limit=-3)
      return self._fail("env_error", f"{self.name}.step() raised {type(e).__name__}: {e}\n{tb}")
    self._rewards.append(step.reward)
    self._tool_calls += int(step.info.get("tool_calls", 0))
    self.messages.extend(step.messages)
    reason = None
    if step.done:
      reason = step.info.get("end_reason", "done")
    elif self._tool_calls > self.limits.max_tool_calls:
      reason = "max_tool_calls"
    elif len(self._rewards) >= self.limits.max_turns:
      reason = "max_turns"
    if reason is None:
      return step
    self._end(reason, None)
    return Step(step.messages, step.reward, True, {**step.info, "end_reason": reason})

  def summary(self) -> EpisodeSummary:
    """How the episode went so far."""
    return EpisodeSummary(
      record_id=self._record_id,
      end_reason=self._end_reason,
      turns=len(self._rewards),
      tool_calls=self._tool_calls,
      rewards=tuple(self._rewards),
      reward=float(sum(self._rewards)),
      error=self._error,
      truncated=self._end_reason in ("max_turns", "max_tool_calls", "max_tokens"),
    )

  def end(self, reason: str) -> None:
    """Ends the episode from outside (the engine: "max_tokens", or an aborted request)."""
    if not self.done:
      self._end(reason, None)

  def fail(self, reason: str, error: str) -> None:
    """Ends the episode as failed from outside, with the failure reward, as a step that broke
    the contract would (its messages could not be rendered into ids)."""
    if not self.done:
      self._fail(reason, error)

  def close(self) -> None:
    """Closes the environment (once; `step` does it when the episode ends)."""
    self._close()

  def _fail(self, reason: str, error: str, level: int = logging.WARNING) -> Step:
    log.log(
      level, "episode of %s (record %r) ended: %s: %s", self.name, self._record_id, reason, error
    )
    reward = self.limits.failure_reward
    self._rewards.append(reward)
    self._end(reason, error)
    return Step([], reward, True, {"end_reason": reason, "error": error})

  def _end(self, reason: str, error: str | None) -> None:
    self.done = True
    self._end_reason = reason
    self._error = error
    self._close()

  def _close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      self.env.close()
    except Exception:
      log.exception("closing environment %s failed", self.name)


Policy = Callable[[list[dict[str, Any]]], "str | Awaitable[str]"]


async def run_episode(
  env: Environment,
  record: dict[str, Any],
  policy: Policy,
  limits: EpisodeLimits,
  *,
  name: str | None = None,
) -> Episode:
  """Plays one episode with a text policy (tests, evaluation of scripted policies, demos).

  Args:
    env: a fresh environment.
    record: the dataset record to reset it with.
    policy: maps the conversation so far (a copy) to the model's next turn; may be async.
    limits: the episode's limits.
    name: how messages name the environment.

  Returns:
    The ended `Episode`: `summary()` for rewards and the end reason, `messages` for the text.
  """
  episode = Episode(env, limits, name=name)
  await episode.reset(record)
  while not episode.done:
    action = policy([dict(m) for m in episode.messages])
    if inspect.isawaitable(action):
      action = await action
    await episode.step(action)
  return episode
