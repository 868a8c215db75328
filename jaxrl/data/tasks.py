"""Verifiable tasks: prompt records and reward functions.

A prompt record is a plain dict `{"id": str, "prompt": str, "answer": str}`, plus fields of its
task (countdown adds `numbers` and `target`; gsm8k and math add `question`, math adds the chat
`messages`). A task's `reward(record, response)` scores the text the model generated after the
prompt (EOS stripped) in [0, 1]; `submit_rewards(records, responses)` scores a batch without
blocking the caller (the math task checks answers in worker processes) and also says how many
checks timed out, and `rewards(records, responses)` waits for it.

Tasks: `arithmetic`, `digit_sort` and `countdown` are synthetic (generated, exact rewards, no
files). `gsm8k` reads a GSM8K-style JSONL file and compares the final number of a response with
the reference's (a fast, dependency-free rule, in process). `math` reads JSONL, Parquet or Arrow
files with configurable fields and answer formats, and checks answers with math-verify
(`jaxrl.data.verify`), so that equivalent forms (0.5 and \\frac12, 1000 and 1,000) score 1; a
GSM8K file read by `math` with `answer_format="gsm8k"` is scored that way too.

Pass@1: with a 0/1 reward (every task's "exact" reward; math with `format_reward_weight` 0), the
held-out evaluation's mean reward over one greedy response per problem (`eval.temperature` 0)
is pass@1, the fraction of problems whose single greedy answer is right. With a format weight,
`RewardBatch.correct_b` still gives it.

Train and test never share a problem: a problem is in the test split when the SHA-256 of its
canonical key is 0 mod 10 (`split_of`), which holds across runs, seeds and machines. The test
split ignores `seed`, so every run evaluates on the same problems, and a smaller test set is a
prefix of a larger one.

This module holds `TaskConfig`, the synthetic tasks and the registry (`TASKS`, `make_task`);
the `Task` base and the split in `jaxrl.data.task_base`, the file tasks in
`jaxrl.data.file_tasks`.
"""

import dataclasses
import functools
import os
from typing import Any, ClassVar

import numpy as np

from jaxrl.data import guess_number, math_data
from jaxrl.data.countdown import evaluate_countdown
from jaxrl.data.file_tasks import Gsm8k, Math
from jaxrl.data.task_base import REWARDS, Task

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Which task to train and evaluate on, and its parameters.

  Attributes:
    name: a key of `TASKS`.
    num_digits: arithmetic: digits per operand (operands are 0 .. 10**num_digits - 1).
    operations: arithmetic: the operators to draw from, a subset of "+-*".
    sort_length: digit_sort: how many digits to sort (the median when `sort_length_max` is set).
    sort_length_max: digit_sort: 0 gives every problem `sort_length` digits; otherwise each
      problem's length is drawn from a long tail (lognormal around `sort_length`, sigma 0.8,
      capped at this), so response lengths are long-tailed too.
    countdown_numbers: countdown: how many numbers are given.
    guess_max_low: guess_number: the lowest end of a range is drawn from 0..guess_max_low.
    guess_widths: guess_number: the sizes a range may have (high - low + 1).
    path: gsm8k: the JSONL file to read; math: a `.jsonl`, `.parquet` or `.arrow` file, or a
      directory of them (split into train and test by file name when it has both, e.g.
      `train-00000-of-00002.parquet`, else by hash).
    eval_size: test records when `records("test", None, ...)` is called.
    reward: "exact", or "partial" for tasks that give partial credit (digit_sort).
    question_field: math: the field with the question.
    answer_field: math: the field with the gold answer or solution.
    messages_field: math: if set, the field with the chat prompt (a list of {"role",
      "content"}), used instead of the question and the instruction.
    answer_format: math: how the gold answer is written in its field: "gsm8k" (last line
      `#### 42`), "boxed" (last `\\boxed{...}` of a solution), "plain" (the field is the
      answer) or "auto" (decided per row from what the text contains).
    system_prompt: math: the system message of the chat prompt; "" for none.
    instruction: math: appended to the question in the prompt.
    format_reward_weight: math: reward = (1 - w) * correct + w * formatted, where formatted
      means the response's last `\\boxed{}` is closed and not empty.
    verify_timeout_s: math: seconds one answer check may take; a check that takes longer
      scores 0 and is counted as a reward timeout.
    reward_workers: math: processes that check answers.
  """

  name: str = "arithmetic"
  num_digits: int = 2
  operations: str = "+"
  sort_length: int = 5
  sort_length_max: int = 0
  countdown_numbers: int = 3
  guess_max_low: int = 50
  guess_widths: tuple[int, ...] = (7, 15)
  path: str = ""
  eval_size: int = 128
  reward: str = "exact"
  question_field: str = "question"
  answer_field: str = "answer"
  messages_field: str = ""
  answer_format: str = "auto"
  system_prompt: str = ""
  instruction: str = MATH_INSTRUCTION
  format_reward_weight: float = 0.0
  verify_timeout_s: float = 5.0
  reward_workers: int = 4

  def __post_init__(self):
    task_cls = _task_class(self.name)
    ranges = {
      "num_digits": (1, 9),
      "sort_length": (1, 18),
      "countdown_numbers": (2, 6),
      "reward_workers": (1, 256),
    }
    for field, (low, high) in ranges.items():
      if not low <= getattr(self, field) <= high:
        raise ValueError(
          f"config.task.{field}={getattr(self, field)}: set it between {low} and {high}."
        )
    if self.sort_length_max and not self.sort_length <= self.sort_length_max <= 18:
      raise ValueError(
        f"config.task.sort_length_max={self.sort_length_max}: set it to 0 (fixed length) or "
        f"between sort_length={self.sort_length} and 18."
      )
    if self.guess_max_low < 0 or not self.guess_widths or min(self.guess_widths) < 1:
      raise ValueError(
        f"config.task.guess_max_low={self.guess_max_low}, guess_widths={self.guess_widths}: "
        "set guess_max_low >= 0 and one or more widths >= 1."
      )
    if self.eval_size < 1:
      raise ValueError(f"config.task.eval_size={self.eval_size}: set it to 1 or more.")
    ops = self.operations
    if not ops or set(ops) - set("+-*") or len(set(ops)) != len(ops):
      raise ValueError(
        f"config.task.operations={ops!r}: use a non-empty string of distinct operators from "
        "'+-*', e.g. '+' or '+-*'."
      )
    if self.reward not in REWARDS:
      raise ValueError(f"config.task.reward={self.reward!r}: use one of {list(REWARDS)}.")
    if self.reward == "partial" and not task_cls.supports_partial:
      partial = [name for name, cls in TASKS.items() if cls.supports_partial]
      raise ValueError(
        f"config.task.reward='partial': task {self.name!r} has no partial credit (tasks that "
        f"do: {partial}); set reward='exact'."
      )
    for field in ("question_field", "answer_field"):
      if not getattr(self, field):
        raise ValueError(f"config.task.{field} is empty: set the name of a field of the rows.")
    if self.answer_format not in math_data.ANSWER_FORMATS:
      raise ValueError(
        f"config.task.answer_format={self.answer_format!r}: use one of "
        f"{list(math_data.ANSWER_FORMATS)}."
      )
    if not 0.0 <= self.format_reward_weight <= 1.0:
      raise ValueError(
        f"config.task.format_reward_weight={self.format_reward_weight}: set it between 0 and 1."
      )
    if not self.verify_timeout_s > 0:
      raise ValueError(
        f"config.task.verify_timeout_s={self.verify_timeout_s}: set it to a positive number "
        "of seconds."
      )
    if task_cls.reads_path:
      self._check_path(task_cls)

  def _check_path(self, task_cls: type["Task"]) -> None:
    what = task_cls.path_kinds
    if not self.path:
      raise ValueError(f"config.task.path is empty: task {self.name!r} reads {what}.")
    if not os.path.exists(self.path):
      raise ValueError(
        f"config.task.path={self.path!r} does not exist (task {self.name!r} reads {what})."
      )
    if os.path.isdir(self.path) and not task_cls.reads_directories:
      raise ValueError(
        f"config.task.path={self.path!r} is a directory; task {self.name!r} reads {what}."
      )
    for suffix, instead in task_cls.other_formats.items():
      if self.path.lower().endswith(suffix):
        raise ValueError(
          f"config.task.path={self.path!r} is a {suffix} file; task {self.name!r} reads "
          f"{what}: {instead}."
        )


class Arithmetic(Task):
  """`"37+45="` -> `"82"`; the response must be the integer (whitespace around it is fine)."""

  name = "arithmetic"

  def _space_size(self) -> int:
    return len(self.cfg.operations) * 10 ** (2 * self.cfg.num_digits)

  def _make(self, index: int) -> dict[str, Any]:
    base = 10**self.cfg.num_digits
    op_index, rest = divmod(index, base * base)
    a, b = divmod(rest, base)
    op = self.cfg.operations[op_index]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(value)}

  def problem_key(self, record: dict[str, Any]) -> str:
    a, op, b = _split_binary(record["prompt"].rstrip("="))
    if op in "+*":  # commutative: 45+37 is the same problem as 37+45.
      a, b = sorted((a, b))
    return f"{a}{op}{b}"

  def reward(self, record: dict[str, Any], response: str) -> float:
    text = response.strip()
    body = text[1:] if text.startswith("-") else text
    if not body.isascii() or not body.isdigit():
      return 0.0
    return float(int(text) == int(record["answer"]))


def _split_binary(expression: str) -> tuple[int, str, int]:
  for i, c in enumerate(expression):
    if i > 0 and c in "+-*":
      return int(expression[:i]), c, int(expression[i + 1 :])
  raise ValueError(f"not a binary expression: {expression!r}")


class DigitSort(Task):
  """`"sort:52913="` -> `"12359"`; partial reward: fraction of positions right."""

  name = "digit_sort"
  supports_partial = True

  def _space_size(self) -> int | None:
    return None if self.cfg.sort_length_max else 10**self.cfg.sort_length

  def _make(self, index: int, length: int | None = None) -> dict[str, Any]:
    digits = str(index).zfill(length or self.cfg.sort_length)
    return {"prompt": f"sort:{digits}=", "answer": "".join(sorted(digits))}

  def _sample(self, rng: np.random.Generator, count: int) -> list[dict[str, Any]]:
    if not self.cfg.sort_length_max:
      return super()._sample(rng, count)
    lengths = np.clip(
      np.round(rng.lognormal(np.log(self.cfg.sort_length), 0.8, count)), 1, self.cfg.sort_length_max
    ).astype(int)
    return [self._make(int(rng.integers(10**n)), int(n)) for n in lengths]

  def reward(self, record: dict[str, Any], response: str) -> float:
    got, want = response.strip(), record["answer"]
    if self.cfg.reward == "exact" or len(got) != len(want):
      return float(got == want)
    return sum(g == w for g, w in zip(got, want, strict=True)) / len(want)


class Countdown(Task):
  """Reach `target` from `numbers` with + - * and parentheses, each number used at most once.

  Prompt: `"countdown:3,7,25 target:250="`; a correct response is e.g. `"(3+7)*25"`. Instances
  are generated from a random expression over all the numbers, so each is solvable; the record's
  `answer` is that expression.
  """

  name = "countdown"
  max_number: ClassVar[int] = 25
  max_target: ClassVar[int] = 999

  def _sample(self, rng: np.random.Generator, count: int) -> list[dict[str, Any]]:
    n = self.cfg.countdown_numbers
    out = []
    # Two numpy calls per block: per-call overhead would dominate generation time.
    numbers_bn = rng.integers(1, self.max_number + 1, (count, n)).tolist()
    picks_bn3 = rng.random((count, n - 1, 3)).tolist()
    for numbers, picks in zip(numbers_bn, picks_bn3, strict=True):
      terms = [(str(x), x) for x in numbers]
      for u_i, u_j, u_op in picks:
        a_text, a = terms.pop(int(u_i * len(terms)))
        b_text, b = terms.pop(int(u_j * len(terms)))
        op = "+-*"[int(u_op * 3)]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        terms.append((f"({a_text}{op}{b_text})", value))
      ((text, target),) = terms
      if 1 <= target <= self.max_target:  # rejected draws simply yield nothing.
        prompt = f"countdown:{','.join(map(str, numbers))} target:{target}="
        out.append({"prompt": prompt, "answer": text[1:-1], "numbers": numbers, "target": target})
    return out

  def problem_key(self, record: dict[str, Any]) -> str:
    return f"{sorted(record['numbers'])}:{record['target']}"

  def reward(self, record: dict[str, Any], response: str) -> float:
    try:
      return float(evaluate_countdown(response, record["numbers"]) == record["target"])
    except ValueError:
      return 0.0


class GuessNumber(Task):
  """The guessing game's problems (`jaxrl.data.guess_number`): `"guess a number from 12 to 18:"`.

  Played over several turns by the environment `guess_number` (`config.env.name`), which gives
  the feedback and the rewards. As a single-turn task, a response scores 1 when its last number
  is the target (a guess in one shot).
  """

  name = "guess_number"

  @functools.cached_property
  def _problems(self) -> list[tuple[int, int, int]]:
    return guess_number.problems(self.cfg.guess_max_low, self.cfg.guess_widths)

  def _space_size(self) -> int:
    return len(self._problems)

  def _make(self, index: int) -> dict[str, Any]:
    return guess_number.make_record(*self._problems[index])

  def problem_key(self, record: dict[str, Any]) -> str:
    return guess_number.problem_key(record["low"], record["high"], record["target"])

  def reward(self, record: dict[str, Any], response: str) -> float:
    return float(guess_number.last_number(response) == record["target"])


TASKS: dict[str, type[Task]] = {
  "arithmetic": Arithmetic,
  "digit_sort": DigitSort,
  "countdown": Countdown,
  "guess_number": GuessNumber,
  "gsm8k": Gsm8k,
  "math": Math,
}


def _task_class(name: str) -> type[Task]:
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}.")
  return TASKS[name]


def make_task(cfg: TaskConfig) -> Task:
  """Builds the task `cfg.name` names.

  Raises:
    ValueError: an unknown task name; the message lists the known ones.
  """
  return _task_class(cfg.name)(cfg)
