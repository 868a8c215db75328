"""The problems of the guessing game: find a hidden whole number in [low, high].

A problem is (low, high, target) with `low` in 0..max_low and `high - low + 1` in `widths`. The
task `guess_number` (`jaxrl.data.tasks`) draws them as prompt records, split into train and
test by the stable hash every task uses; the game itself, with its feedback and rewards, is the
environment `jaxrl.envs.GuessNumberEnv`. Every text is lowercase letters, digits, spaces and
":", so the char tokenizer can encode it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def optimal_guesses(low: int, high: int) -> int:
  """Guesses binary search needs in the worst case to find a number in [low, high]."""
  return math.ceil(math.log2(high - low + 2))


def prompt_text(low: int, high: int) -> str:
  """The first user message of a problem."""
  return f"guess a number from {low} to {high}:"


def last_number(text: str) -> int | None:
  """The last whole number written in `text` (a guess), or None."""
  numbers = _NUMBER.findall(text)
  return int(numbers[-1]) if numbers else None


def problems(max_low: int, widths: Sequence[int]) -> list[tuple[int, int, int]]:
  """Every (low, high, target) of the game, in a fixed order."""
  return [
    (low, low + width - 1, target)
    for low in range(max_low + 1)
    for width in widths
    for target in range(low, low + width)
  ]


def problem_key(low: int, high: int, target: int) -> str:
  """The problem's canonical key (what the train/test split hashes)."""
  return f"guess_number:{low}:{high}:{target}"


def make_record(low: int, high: int, target: int) -> dict[str, Any]:
  """A prompt record: `{"prompt", "messages", "low", "high", "target", "answer"}` ("prompt" is
  the text for tokenizers without a chat template, "answer" the target as a str)."""
  text = prompt_text(low, high)
  return {
    "prompt": text,
    "messages": [{"role": "user", "content": text}],
    "low": low,
    "high": high,
    "target": target,
    "answer": str(target),
  }
