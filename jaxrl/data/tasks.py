"""Verifiable tasks: prompt records and reward functions.

A prompt record is a plain dict `{"id": str, "prompt": str, "answer": str}`, plus fields of its
task (countdown adds `numbers` and `target`). A task's `reward(record, response)` scores the text
the model generated after the prompt (EOS stripped) in [0, 1].

Train and test never share a problem: a problem is in the test split when the SHA-256 of its
canonical key is 0 mod 10 (`split_of`), which holds across runs, seeds and machines. The test
split ignores `seed`, so every run evaluates on the same problems, and a smaller test set is a
prefix of a larger one.
"""

import dataclasses
import hashlib
import re
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from jaxrl.data import gsm8k

SPLITS = ("train", "test")
REWARDS = ("exact", "partial")
MAX_TRAIN_RECORDS = 100_000  # train records when num=None: bounded, to keep memory sane.
ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are enumerated, larger ones sampled.
_TEST_SEED = 20_240_601  # fixed: the test split must not depend on the run's seed.
_TEST_MODULUS = 10
_SAMPLE_BLOCK = 1024  # problems drawn per numpy call when sampling.


def split_of(key: str) -> str:
  """Returns "test" or "train" for a problem's canonical key, from a stable hash."""
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return "test" if int.from_bytes(digest[:8], "little") % _TEST_MODULUS == 0 else "train"


def _record_id(task: str, key: str) -> str:
  return f"{task}-{hashlib.sha256(key.encode('utf-8')).hexdigest()[:12]}"


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
    path: gsm8k: the JSONL file to read.
    eval_size: test records when `records("test", None, ...)` is called.
    reward: "exact", or "partial" for tasks that give partial credit (digit_sort).
  """

  name: str = "arithmetic"
  num_digits: int = 2
  operations: str = "+"
  sort_length: int = 5
  sort_length_max: int = 0
  countdown_numbers: int = 3
  path: str = ""
  eval_size: int = 128
  reward: str = "exact"

  def __post_init__(self):
    task_cls = _task_class(self.name)
    ranges = {"num_digits": (1, 9), "sort_length": (1, 18), "countdown_numbers": (2, 6)}
    for field, (low, high) in ranges.items():
      if not low <= getattr(self, field) <= high:
        raise ValueError(
          f"TaskConfig.{field}={getattr(self, field)}: set it between {low} and {high}."
        )
    if self.sort_length_max and not self.sort_length <= self.sort_length_max <= 18:
      raise ValueError(
        f"TaskConfig.sort_length_max={self.sort_length_max}: set it to 0 (fixed length) or "
        f"between sort_length={self.sort_length} and 18."
      )
    if self.eval_size < 1:
      raise ValueError(f"TaskConfig.eval_size={self.eval_size}: set it to 1 or more.")
    ops = self.operations
    if not ops or set(ops) - set("+-*") or len(set(ops)) != len(ops):
      raise ValueError(
        f"TaskConfig.operations={ops!r}: use a non-empty string of distinct operators from "
        "'+-*', e.g. '+' or '+-*'."
      )
    if self.reward not in REWARDS:
      raise ValueError(f"TaskConfig.reward={self.reward!r}: use one of {list(REWARDS)}.")
    if self.reward == "partial" and not task_cls.supports_partial:
      partial = [name for name, cls in TASKS.items() if cls.supports_partial]
      raise ValueError(
        f"TaskConfig.reward='partial': task {self.name!r} has no partial credit (tasks that do: "
        f"{partial}); set reward='exact'."
      )
    if self.name == "gsm8k" and not self.path:
      raise ValueError("TaskConfig.path is empty: task 'gsm8k' needs the path of a JSONL file.")


class Task:
  """Base of the synthetic tasks: problems are drawn, split by hash, and deduplicated.

  A subclass defines `_make(index)` over a problem space of `_space_size()` problems (small
  spaces are enumerated in a seeded order, large ones sampled), or overrides `_sample` to draw
  a block of problems.
  """

  name: ClassVar[str] = ""
  supports_partial: ClassVar[bool] = False

  def __init__(self, cfg: TaskConfig):
    self.cfg = cfg

  def _space_size(self) -> int | None:
    return None

  def _make(self, index: int) -> dict[str, Any]:
    raise NotImplementedError

  def _sample(self, rng: np.random.Generator, count: int) -> list[dict[str, Any]]:
    return [self._make(i) for i in rng.integers(self._space_size(), size=count).tolist()]

  def problem_key(self, record: dict[str, Any]) -> str:
    """The canonical form of a record's problem: equal keys are the same problem."""
    return record["prompt"]

  def _candidates(self, rng: np.random.Generator) -> Iterator[dict[str, Any]]:
    size = self._space_size()
    if size is not None and size <= ENUMERATE_LIMIT:
      for index in rng.permutation(size):
        yield self._make(int(index))
    else:
      while True:
        yield from self._sample(rng, _SAMPLE_BLOCK)

  def records(self, split: str, num: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Returns `num` distinct problems of `split` as prompt records.

    Args:
      split: "train" or "test".
      num: how many; None means `cfg.eval_size` for test and up to `MAX_TRAIN_RECORDS` for
        train, fewer if the split has fewer problems.
      seed: which train problems, in which order; the test split ignores it.

    Raises:
      ValueError: an unknown split, or `num` larger than the split's number of problems.
    """
    _check_split(split)
    limit = (
      num if num is not None else (self.cfg.eval_size if split == "test" else MAX_TRAIN_RECORDS)
    )
    rng = np.random.default_rng(_TEST_SEED if split == "test" else seed)
    # Bounds the time spent collecting distinct problems from a sampled space that is nearly
    # exhausted: about 4x the draws needed while most draws are new.
    max_draws = limit * (4 * _TEST_MODULUS if split == "test" else 4) + 20_000
    out, seen = [], set()
    for draws, record in enumerate(self._candidates(rng)):
      if len(out) >= limit or draws >= max_draws:
        break
      key = self.problem_key(record)
      if key in seen or split_of(key) != split:
        continue
      seen.add(key)
      record["id"] = _record_id(self.name, key)
      out.append(record)
    if num is not None and len(out) < num:
      raise ValueError(
        f"task {self.name!r} has only {len(out)} distinct {split} problems under {self.cfg}; "
        f"ask for fewer or make the problem space larger."
      )
    return out

  def reward(self, record: dict[str, Any], response: str) -> float:
    """Scores `response` to `record` in [0, 1]."""
    raise NotImplementedError


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


_MAX_EXPRESSION_CHARS = 256
_MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*([0-9]+|[-+*()])")


def evaluate_countdown(expression: str, numbers: list[int]) -> int:
  """Evaluates a countdown expression without `eval`.

  Grammar: integers, binary `+ - *`, parentheses and whitespace; no unary minus. Each integer
  must be one of `numbers`, used at most as often as it occurs there.

  Raises:
    ValueError: the expression is malformed or uses a number it may not; the message says why.
  """
  if len(expression) > _MAX_EXPRESSION_CHARS:
    raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
  tokens, i = [], 0
  while (match := _TOKEN.match(expression, i)) is not None:
    tokens.append(match.group(1))
    i = match.end()
  if expression[i:].strip():
    i += len(expression[i:]) - len(expression[i:].lstrip())
    raise ValueError(
      f"character {expression[i]!r} at position {i} is not allowed; use digits, + - * ( )"
    )
  available = list(numbers)
  pos = 0

  def peek() -> str | None:
    return tokens[pos] if pos < len(tokens) else None

  def parse_sum(depth: int) -> int:
    nonlocal pos
    value = parse_product(depth)
    while peek() in ("+", "-"):
      op = tokens[pos]
      pos += 1
      rhs = parse_product(depth)
      value = value + rhs if op == "+" else value - rhs
    return value

  def parse_product(depth: int) -> int:
    nonlocal pos
    value = parse_atom(depth)
    while peek() == "*":
      pos += 1
      value *= parse_atom(depth)
    return value

  def parse_atom(depth: int) -> int:
    nonlocal pos
    token = peek()
    if token == "(":
      if depth >= _MAX_DEPTH:
        raise ValueError(f"parentheses nested deeper than {_MAX_DEPTH}")
      pos += 1
      value = parse_sum(depth + 1)
      if peek() != ")":
        raise ValueError("unbalanced parentheses: expected ')'")
      pos += 1
      return value
    if token is None or not token[0].isdigit():
      raise ValueError(f"expected a number or '(' at token {pos}, got {token!r}")
    pos += 1
    value = int(token)
    if value not in available:
      raise ValueError(f"number {value} is not among {list(numbers)} or is used too often")
    available.remove(value)
    return value

  value = parse_sum(0)
  if pos != len(tokens):
    raise ValueError(f"unexpected {tokens[pos]!r} at token {pos}")
  return value


class Gsm8k(Task):
  """Grade-school word problems from a GSM8K-style JSONL file (`TaskConfig.path`)."""

  name = "gsm8k"

  def __init__(self, cfg: TaskConfig):
    super().__init__(cfg)
    self._all: list[dict[str, Any]] | None = None

  def problem_key(self, record: dict[str, Any]) -> str:
    return " ".join(record["question"].split())

  def records(self, split: str, num: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Returns records of `split`: test in file order, train shuffled by `seed`.

    Raises:
      ValueError: an unknown split, or `num` larger than the split.
      gsm8k.DatasetError: a malformed file.
    """
    _check_split(split)
    if self._all is None:
      self._all = gsm8k.load_prompt_records(self.cfg.path)
    pool = [r for r in self._all if split_of(self.problem_key(r)) == split]
    if split == "train":
      pool = [pool[i] for i in np.random.default_rng(seed).permutation(len(pool))]
    if num is None:
      num = min(len(pool), self.cfg.eval_size) if split == "test" else len(pool)
    if num > len(pool):
      raise ValueError(
        f"{self.cfg.path} has {len(pool)} {split} problems, fewer than the {num} asked for."
      )
    return [dict(r) for r in pool[:num]]

  def reward(self, record: dict[str, Any], response: str) -> float:
    return gsm8k.reward(record["answer"], response)


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split {split!r}: use one of {list(SPLITS)}.")


TASKS: dict[str, type[Task]] = {
  "arithmetic": Arithmetic,
  "digit_sort": DigitSort,
  "countdown": Countdown,
  "gsm8k": Gsm8k,
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
