"""What every task shares: the `Task` base (problems drawn, split by hash and deduplicated;
rewards scored through `submit_rewards`), `RewardBatch`, and the train/test split of a problem
(`split_of`). `jaxrl.data.tasks` has the synthetic tasks, the task registry and `TaskConfig`;
`jaxrl.data.file_tasks` the tasks read from files."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # for annotations only: `tasks` imports this module
  from jaxrl.data.tasks import TaskConfig

SPLITS = ("train", "test")
REWARDS = ("exact", "partial")
MAX_TRAIN_RECORDS = 100_000  # train records when num=None: bounded, to keep memory sane.
ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are enumerated, larger ones sampled.
_TEST_SEED = 20_240_601  # fixed: the test split must not depend on the run's seed.
_TEST_MODULUS = 10
_SAMPLE_BLOCK = 1024  # problems drawn per numpy call when sampling.

log = logging.getLogger(__name__)


def split_of(key: str) -> str:
  """Returns "test" or "train" for a problem's canonical key, from a stable hash."""
  return _split_of_digest(_key_digest(key))


def _key_digest(key: str) -> bytes:
  """The stable hash of a problem's key that its split and its record id come from."""
  return hashlib.sha256(key.encode("utf-8")).digest()


def _split_of_digest(digest: bytes) -> str:
  return "test" if int.from_bytes(digest[:8], "little") % _TEST_MODULUS == 0 else "train"


def _record_id(task: str, digest: bytes) -> str:
  """A record's id from its key's digest (`_key_digest`)."""
  return f"{task}-{digest[:6].hex()}"


@dataclasses.dataclass(frozen=True)
class RewardBatch:
  """The scores of a batch of responses.

  Attributes:
    rewards_b: each response's reward in [0, 1] (float32).
    correct_b: whether each response got full credit for its answer (bool); with a 0/1
      reward it equals `rewards_b == 1`, and its mean over greedy responses is pass@1.
    timeouts: responses whose check timed out or crashed; they score 0 (the RL loop logs this
      as `reward_timeouts`).
  """

  rewards_b: np.ndarray
  correct_b: np.ndarray
  timeouts: int = 0


class Task:
  """Base of the synthetic tasks: problems are drawn, split by hash, and deduplicated.

  A subclass defines `_make(index)` over a problem space of `_space_size()` problems (small
  spaces are enumerated in a seeded order, large ones sampled), or overrides `_sample` to draw
  a block of problems.
  """

  name: ClassVar[str] = ""
  supports_partial: ClassVar[bool] = False
  reads_path: ClassVar[bool] = False  # `cfg.path` must name an existing file (or directory)
  reads_directories: ClassVar[bool] = False
  path_kinds: ClassVar[str] = ""  # what `cfg.path` may name, for messages
  # File suffixes `cfg.path` must not have, each with what to do instead (for the message).
  other_formats: ClassVar[dict[str, str]] = {}

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
    check_split(split)
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
      if key in seen:
        continue
      digest = _key_digest(key)  # one hash: the split and the id
      if _split_of_digest(digest) != split:
        continue
      seen.add(key)
      record["id"] = _record_id(self.name, digest)
      out.append(record)
    if num is not None and len(out) < num and split == "test":  # `config.eval.num_prompts`
      log.warning(
        "config.eval.num_prompts=%d asks for more test problems than task %r has (%d): "
        "evaluating on all %d.",
        num, self.name, len(out), len(out),
      )  # fmt: skip
    elif num is not None and len(out) < num:
      raise ValueError(
        f"task {self.name!r} has only {len(out)} distinct {split} problems under {self.cfg}; "
        f"ask for fewer or make the problem space larger."
      )
    return out

  def reward(self, record: dict[str, Any], response: str) -> float:
    """Scores `response` to `record` in [0, 1]."""
    raise NotImplementedError

  def submit_rewards(self, records: Sequence[dict[str, Any]], responses: Sequence[str]) -> Future:
    """Scores `responses[i]` to `records[i]`; a future of a `RewardBatch`.

    Here the scores are computed at once with `reward` and the future is done on return; a
    task whose checks are slow (math) returns at once and completes the future later, from
    another thread. Safe to call from any thread.
    """
    check_lengths(records, responses)
    rewards_b = np.array(
      [self.reward(r, t) for r, t in zip(records, responses, strict=True)], np.float32
    )
    future = Future()
    future.set_result(RewardBatch(rewards_b=rewards_b, correct_b=rewards_b == 1.0))
    return future

  def rewards(self, records: Sequence[dict[str, Any]], responses: Sequence[str]) -> np.ndarray:
    """The rewards (float32) of `responses[i]` to `records[i]`, waiting for them."""
    return self.submit_rewards(records, responses).result().rewards_b

  def close(self) -> None:
    """Releases what the task holds (the math task's answer-checking processes)."""

  def __enter__(self) -> Task:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def check_lengths(records: Sequence[Any], responses: Sequence[str]) -> None:
  if len(records) != len(responses):
    raise ValueError(f"{len(records)} records but {len(responses)} responses.")


def check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split {split!r}: use one of {list(SPLITS)}.")
