"""Tasks over the problems of dataset files: `gsm8k` (GSM8K-style JSONL, the final number
compared in process) and `math` (JSONL, Parquet or Arrow; answers checked with math-verify in
worker processes). What they read and how they score: `jaxrl.data.tasks`'s docstring."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl.data import gsm8k, math_data, verify
from jaxrl.data.task_base import SPLITS, RewardBatch, Task, check_lengths, check_split, split_of

if TYPE_CHECKING:  # for annotations only: `tasks` imports this module
  from jaxrl.data.tasks import TaskConfig

log = logging.getLogger(__name__)


class _FileTask(Task):
  """A task over the problems of a dataset: the test split in file order, train shuffled."""

  reads_path = True

  def __init__(self, cfg: TaskConfig):
    super().__init__(cfg)
    self._splits: dict[str, list[dict[str, Any]]] | None = None

  def _load_splits(self) -> dict[str, list[dict[str, Any]]]:
    """Reads the records, as {"train": [...], "test": [...]}."""
    raise NotImplementedError

  def _hash_split(self, records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {s: [r for r in records if split_of(self.problem_key(r)) == s] for s in SPLITS}

  def problem_key(self, record: dict[str, Any]) -> str:
    return math_data.problem_key(record["question"])

  def records(self, split: str, num: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Returns records of `split`: test in file order, train shuffled by `seed`.

    Raises:
      ValueError: an unknown split, or `num` larger than the train split (a larger test `num`
        gives the whole test split, with a warning).
      gsm8k.DatasetError: a malformed file.
    """
    check_split(split)
    if self._splits is None:
      self._splits = self._load_splits()
    pool = self._splits[split]
    if split == "train":
      pool = [pool[i] for i in np.random.default_rng(seed).permutation(len(pool))]
    if num is None:
      num = min(len(pool), self.cfg.eval_size) if split == "test" else len(pool)
    if num > len(pool) and split == "test":  # `config.eval.num_prompts`: evaluate on them all
      log.warning(
        "config.eval.num_prompts=%d asks for more test problems than %s has (%d): evaluating on "
        "all %d.",
        num, self.cfg.path, len(pool), len(pool),
      )  # fmt: skip
      num = len(pool)
    if num > len(pool):
      raise ValueError(
        f"{self.cfg.path} has {len(pool)} {split} problems, fewer than the {num} asked for."
      )
    return [dict(r) for r in pool[:num]]


class Gsm8k(_FileTask):
  """Grade-school word problems from a GSM8K-style JSONL file (`TaskConfig.path`).

  The reward compares the last number of the response with the reference's `####` number
  (`gsm8k.reward`): quick, in process, with no dependency. For math-verify checking of the
  same file, use the `math` task with `answer_format="gsm8k"`.
  """

  name = "gsm8k"
  path_kinds = "a GSM8K-style JSONL file"
  # GSM8K's Hub form is Parquet; the math task reads it, with the same fields and answers.
  other_formats = dict.fromkeys(
    (".parquet", ".arrow"),
    "set config.task.name='math' with config.task.answer_format='gsm8k', which reads Parquet "
    "and Arrow (GSM8K's question and answer fields are its defaults) and checks answers with "
    "math-verify; or convert the file to JSONL",
  )

  def _load_splits(self) -> dict[str, list[dict[str, Any]]]:
    return self._hash_split(gsm8k.load_prompt_records(self.cfg.path))

  def reward(self, record: dict[str, Any], response: str) -> float:
    return gsm8k.reward(record["answer"], response)


class Math(_FileTask):
  """Math problems from JSONL, Parquet or Arrow files, answers checked with math-verify.

  Records come from `math_data.load_records` (fields, answer format, prompt and chat messages
  as `TaskConfig` sets them); every gold answer is parsed by math-verify when the data loads
  (plain numbers, which parse by construction, without a worker: `VerifierPool.check_answers`).
  The train and test splits are the files' when the path is a directory with both (files named
  otherwise, such as `validation-*`, are then left out; train rows whose problem is in the test
  files are dropped, with a warning), else the hash split of every row. A
  response scores 1 when math-verify finds its final answer equal to the gold (0 when it has
  none, or its check times out), mixed with the format check by `format_reward_weight`. The
  checks run in a `verify.VerifierPool`, given or made at first use with `reward_workers`
  processes and `verify_timeout_s`; `close()` stops a pool the task made.
  """

  name = "math"
  reads_directories = True
  path_kinds = "a .jsonl, .parquet or .arrow file or a directory of them"

  def __init__(self, cfg: TaskConfig, verifier: verify.VerifierPool | None = None):
    super().__init__(cfg)
    self._verifier = verifier
    self._owns_verifier = verifier is None
    self._lock = threading.Lock()

  @property
  def verifier(self) -> verify.VerifierPool:
    """The pool that checks answers (made at first use unless one was given)."""
    with self._lock:
      if self._verifier is None:
        self._verifier = verify.VerifierPool(self.cfg.reward_workers, self.cfg.verify_timeout_s)
      return self._verifier

  def _load_splits(self) -> dict[str, list[dict[str, Any]]]:
    c = self.cfg
    by_file = math_data.load_records(
      c.path,
      check_answers=lambda answers: self.verifier.check_answers(answers).result(),
      question_field=c.question_field,
      answer_field=c.answer_field,
      messages_field=c.messages_field,
      answer_format=c.answer_format,
      system_prompt=c.system_prompt,
      instruction=c.instruction,
    )
    if "train" in by_file and "test" in by_file:
      return {"train": self._without_test_problems(by_file), "test": by_file["test"]}
    return self._hash_split([r for records in by_file.values() for r in records])

  def _without_test_problems(self, by_file: dict[Any, list[dict[str, Any]]]):
    """The train files' records less those whose problem is also in the test files: trained
    on, it would be evaluated as held out (datasets' splits do overlap, and so may files put
    together by hand)."""
    test_keys = {self.problem_key(r) for r in by_file["test"]}
    train = [r for r in by_file["train"] if self.problem_key(r) not in test_keys]
    dropped = len(by_file["train"]) - len(train)
    if not train:
      raise gsm8k.DatasetError(
        f"{self.cfg.path}: every one of the {dropped} train rows is a problem of the test "
        "files; give train files with other problems (config.task.path)."
      )
    if dropped:
      log.warning(
        "%s: dropped %d of %d train rows whose problem is also in the test files, so that "
        "evaluation measures problems the policy did not train on.",
        self.cfg.path,
        dropped,
        len(by_file["train"]),
      )
    return train

  def reward(self, record: dict[str, Any], response: str) -> float:
    return float(self.rewards([record], [response])[0])

  def submit_rewards(self, records: Sequence[dict[str, Any]], responses: Sequence[str]) -> Future:
    """Sends the batch to the verifier pool; the future completes when every check is done."""
    check_lengths(records, responses)
    w = self.cfg.format_reward_weight
    formatted_b = np.array([verify.has_boxed_answer(t) for t in responses], bool)

    def combine(verdicts: verify.Verdicts) -> RewardBatch:
      rewards_b = (1.0 - w) * verdicts.correct_b + w * formatted_b
      return RewardBatch(
        rewards_b.astype(np.float32), correct_b=verdicts.correct_b, timeouts=verdicts.failures
      )

    answers = [r["answer"] for r in records]
    return verify.then(self.verifier.verify(answers, list(responses)), combine)

  def close(self) -> None:
    with self._lock:
      if self._owns_verifier and self._verifier is not None:
        self._verifier.close()
        self._verifier = None
