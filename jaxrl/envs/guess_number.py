"""`guess_number`: find a hidden whole number from "higher" / "lower" feedback.

A small multi-turn task for tests and the CPU demo. Each turn the model answers with a number
(the last whole number in its turn counts); the environment says "higher" or "lower", or ends
the episode when the guess is right or the guesses are used up. Reward (in [0, 1], at the end):
1 when found within `optimal_guesses(low, high)` guesses (what binary search needs in the worst
case, so the optimal policy always scores 1), `late_reward` when found later, 0 when not found.
A turn without a number, or out of range, is answered with the range and costs a guess. Every
text is lowercase letters, digits, spaces and ":", so the char tokenizer can encode it.

`records(split, num, seed)` makes the dataset: problems are (low, high, target) with `low` in
0..max_low and `high - low + 1` in `widths`; a problem is held out ("test") by the stable hash
of `jaxrl.data.tasks.split_of`, so the two splits never share one. The test split does not
depend on `seed` and a smaller one is a prefix of a larger one; train records are drawn from
the train problems with `seed`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.data.tasks import split_of
from jaxrl.envs.base import EnvError, Environment, Step

_NUMBER = re.compile(r"-?\d+")
_TEST_SEED = 20_240_601  # the test split's order: fixed, so every run evaluates the same records


def optimal_guesses(low: int, high: int) -> int:
  """Guesses binary search needs in the worst case to find a number in [low, high]."""
  return math.ceil(math.log2(high - low + 2))


def prompt_text(low: int, high: int) -> str:
  """The first user message of a problem."""
  return f"guess a number from {low} to {high}:"


class GuessNumberEnv(Environment):
  """The guessing game for one record `{"low", "high", "target"}` (see the module docstring).

  Args:
    max_guesses: guesses before the game is lost; at least `optimal_guesses` of any record.
    late_reward: the reward for finding the number after `optimal_guesses` guesses.
  """

  def __init__(self, *, max_guesses: int = 6, late_reward: float = 0.5):
    if max_guesses < 1:
      raise ValueError(f"max_guesses must be >= 1, got {max_guesses}")
    if not 0.0 <= late_reward <= 1.0:
      raise ValueError(f"late_reward must be in [0, 1], got {late_reward}")
    self.max_guesses = max_guesses
    self.late_reward = late_reward
    self._low = self._high = self._target = 0
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
    self._guesses = 0
    return [{"role": "user", "content": prompt_text(low, high)}]

  def step(self, action: str) -> Step:
    self._guesses += 1
    numbers = _NUMBER.findall(action)
    guess = int(numbers[-1]) if numbers else None
    info: dict[str, Any] = {"guesses": self._guesses, "guess": guess}
    if guess == self._target:
      found_early = self._guesses <= optimal_guesses(self._low, self._high)
      reward = 1.0 if found_early else self.late_reward
      return Step([], reward, True, {**info, "solved": True, "end_reason": "solved"})
    if self._guesses >= self.max_guesses:
      return Step([], 0.0, True, {**info, "solved": False, "end_reason": "out_of_guesses"})
    if guess is None or not self._low <= guess <= self._high:
      feedback = f"answer with a number from {self._low} to {self._high}"
    else:
      feedback = "higher" if guess < self._target else "lower"
    return Step([{"role": "user", "content": feedback}], 0.0, False, info)


def problems(max_low: int, widths: Sequence[int]) -> list[tuple[int, int, int]]:
  """Every (low, high, target) of the task, in a fixed order."""
  return [
    (low, low + width - 1, target)
    for low in range(max_low + 1)
    for width in widths
    for target in range(low, low + width)
  ]


def records(
  split: str,
  num: int,
  seed: int = 0,
  *,
  max_low: int = 50,
  widths: Sequence[int] = (7, 15),
) -> list[dict[str, Any]]:
  """`num` records of a split ("train" or "test"); see the module docstring.

  Each is `{"id", "prompt", "messages", "low", "high", "target", "answer"}` ("prompt" is the
  text for tokenizers without a chat template, "answer" the target as a str).

  Raises:
    ValueError: an unknown split, a bad range, or more test records than the split has.
  """
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if max_low < 0 or not widths or min(widths) < 1:
    raise ValueError(f"need max_low >= 0 and widths >= 1, got {max_low}, {widths}")
  pool = [p for p in problems(max_low, widths) if split_of(_key(*p)) == split]
  if not pool:
    raise ValueError(f"guess_number: no {split} problems for max_low={max_low}, widths={widths}")
  if split == "test":
    if num > len(pool):
      raise ValueError(f"guess_number: asked for {num} test records, the split has {len(pool)}")
    order = np.random.default_rng(_TEST_SEED).permutation(len(pool))[:num]
  else:
    order = np.random.default_rng(seed).integers(0, len(pool), num)
  return [_record(*pool[i]) for i in order]


def _key(low: int, high: int, target: int) -> str:
  return f"guess_number:{low}:{high}:{target}"


def _record(low: int, high: int, target: int) -> dict[str, Any]:
  text = prompt_text(low, high)
  return {
    "id": _key(low, high, target),
    "prompt": text,
    "messages": [{"role": "user", "content": text}],
    "low": low,
    "high": high,
    "target": target,
    "answer": str(target),
  }
