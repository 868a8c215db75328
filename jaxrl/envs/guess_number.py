"""`guess_number`: find a hidden whole number from "higher" / "lower" feedback.

A small multi-turn task for tests and the CPU demo. Each turn the model answers with a number
(the last whole number in its turn counts); the environment says "higher" or "lower", or ends
the episode when the guess is right or the guesses are used up. Reward (in [0, 1], at the end):
1 when found within `optimal_guesses(low, high)` guesses (what binary search needs in the worst
case, so the optimal policy always scores 1), `late_reward` when found later, 0 when not found.
A turn without a number, or out of range, is answered with the range and costs a guess. With
`say_range` the feedback also names the range still possible ("higher: 16 to 18"), so a
policy need read only the last message (what the CPU demo's tiny model can learn). Every text is
lowercase letters, digits, spaces and ":", so the char tokenizer can encode it.

The problems come from the task `guess_number` (`jaxrl.data.guess_number`); `records(split,
num, seed)` here draws them with the task's train/test split.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.data.guess_number import last_number, optimal_guesses, problems, prompt_text
from jaxrl.data.tasks import TaskConfig, make_task
from jaxrl.envs.base import EnvError, Environment, Step

__all__ = [
  "DelayedGuessNumberEnv",
  "GuessNumberEnv",
  "optimal_guesses",
  "problems",
  "prompt_text",
  "records",
]


class GuessNumberEnv(Environment):
  """The guessing game for one record `{"low", "high", "target"}` (see the module docstring).

  Args:
    max_guesses: guesses before the game is lost; at least `optimal_guesses` of any record.
    late_reward: the reward for finding the number after `optimal_guesses` guesses.
    say_range: the feedback names the range still possible ("higher: 16 to 18").
  """

  def __init__(self, *, max_guesses: int = 6, late_reward: float = 0.5, say_range: bool = False):
    if max_guesses < 1:
      raise ValueError(f"max_guesses must be >= 1, got {max_guesses}")
    if not 0.0 <= late_reward <= 1.0:
      raise ValueError(f"late_reward must be in [0, 1], got {late_reward}")
    self.max_guesses = max_guesses
    self.late_reward = late_reward
    self.say_range = say_range
    self._low = self._high = self._target = 0
    self._possible = (0, 0)  # the range the feedback so far leaves
    self._guesses = 0

  def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    try:
      low, high, target = (int(record[k]) for k in ("low", "high", "target"))
    except (KeyError, TypeError, ValueError) as e:
      raise EnvError(
        f"guess_number: record {record.get('id', '?')!r} needs integer 'low', 'high' and "
        f"'target' ({type(e).__name__}: {e}); make records with jaxrl.envs.guess_number.records"
      ) from None
    if not low <= target <= high:
      raise EnvError(f"guess_number: record {record.get('id', '?')!r}: target not in [low, high]")
    if optimal_guesses(low, high) > self.max_guesses:
      raise EnvError(
        f"guess_number: the range {low}..{high} needs {optimal_guesses(low, high)} guesses, "
        f"more than max_guesses={self.max_guesses}"
      )
    self._low, self._high, self._target = low, high, target
    self._possible = (low, high)
    self._guesses = 0
    return [{"role": "user", "content": prompt_text(low, high)}]

  def step(self, action: str) -> Step:
    self._guesses += 1
    guess = last_number(action)
    info: dict[str, Any] = {"guesses": self._guesses, "guess": guess}
    if guess == self._target:
      found_early = self._guesses <= optimal_guesses(self._low, self._high)
      reward = 1.0 if found_early else self.late_reward
      return Step([], reward, True, {**info, "solved": True, "end_reason": "solved"})
    if self._guesses >= self.max_guesses:
      return Step([], 0.0, True, {**info, "solved": False, "end_reason": "out_of_guesses"})
    low, high = self._possible
    if guess is None or not self._low <= guess <= self._high:
      low, high = (low, high) if self.say_range else (self._low, self._high)
      feedback = f"answer with a number from {low} to {high}"
    else:
      higher = guess < self._target
      feedback = "higher" if higher else "lower"
      low, high = (max(low, guess + 1), high) if higher else (low, min(high, guess - 1))
      self._possible = (low, high)
      if self.say_range:
        feedback += f": {low} to {high}"
    return Step([{"role": "user", "content": feedback}], 0.0, False, info)

  def scripted_action(self, rng: np.random.Generator) -> str:
    """A number drawn uniformly from the range the feedback so far leaves: a policy that uses
    the feedback but does not bisect (about 0.6 reward on widths 7 and 15), for a warm-up
    that leaves RL something to learn."""
    low, high = self._possible
    return str(int(rng.integers(low, high + 1)))


def records(
  split: str,
  num: int,
  seed: int = 0,
  *,
  max_low: int = 50,
  widths: Sequence[int] = (7, 15),
) -> list[dict[str, Any]]:
  """`num` distinct records of a split ("train" or "test") of the task `guess_number`.

  Raises:
    ValueError: an unknown split, a bad range, or more records than the split has.
  """
  cfg = TaskConfig(name="guess_number", guess_max_low=max_low, guess_widths=tuple(widths))
  return make_task(cfg).records(split, num, seed)


class DelayedGuessNumberEnv(GuessNumberEnv):
  """The guessing game with a simulated tool latency: each step waits (asynchronously, holding
  no thread) a lognormal time with median `delay_s` and shape `delay_sigma` before it answers,
  as a remote tool or a slow environment would; the answers are `GuessNumberEnv`'s. The waits
  are drawn from the record and the guess count, so a run repeats them. For the agent
  benchmark (`launch/bench.py agent`) and the tests of tool latency.
  """

  def __init__(self, *, delay_s: float = 0.5, delay_sigma: float = 1.0, **kwargs):
    super().__init__(**kwargs)
    if delay_s < 0 or delay_sigma < 0:
      raise ValueError(f"delay_s and delay_sigma must be >= 0, got {delay_s}, {delay_sigma}")
    self.delay_s, self.delay_sigma = delay_s, delay_sigma
    self._key = 0

  def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    messages = super().reset(record)
    self._key = int(record["low"]) * 1_000_003 + int(record["high"]) * 1009 + int(record["target"])
    return messages

  async def step(self, action: str) -> Step:  # type: ignore[override]
    rng = np.random.default_rng([self._key, self._guesses])
    if self.delay_s:
      await asyncio.sleep(self.delay_s * float(np.exp(self.delay_sigma * rng.standard_normal())))
    return super().step(action)
