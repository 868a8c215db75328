"""The synchronous RL controller: sample -> generate -> reward -> advantages -> update -> publish.

Every step runs the stages one after another on their own meshes and times each one, so the
metrics show where a step's time goes (rollout / reward / train / weight sync).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import tqdm

from jaxrl.data.prompts import encode_prompt
from jaxrl.data.tasks import RewardBatch, Task
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.metrics import MetricsWriter
from jaxrl.rl.backends import Backend
from jaxrl.rl.checkpoint import Checkpointer
from jaxrl.rl.experience import build_batch
from jaxrl.rl.timeline import LEARNER_LANE, StageTimeline
from jaxrl.rl.weights import WeightStore
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.train.advantages import group_advantages
from jaxrl.train.learner import Learner

if TYPE_CHECKING:
  from jaxrl.rl.policy import PolicyExporter

log = logging.getLogger(__name__)

ROLLOUT_LANE = "rollout"  # the synchronous loop's rollout engine


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
  """What the controller needs from the experiment config."""

  steps: int
  prompts_per_step: int
  group_size: int
  sampling: SamplingParams
  advantage: str
  eval_every: int
  eval_sampling: SamplingParams
  checkpoint_every: int
  seed: int
  dynamic_sampling_rounds: int = 0  # 0: off; else DAPO dynamic sampling with this many rounds
  # Chat-template variables of every prompt, e.g. {"enable_thinking": False}.
  template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Drop the rollout engine's weights and cache during each update (it shares the learner's
  # devices); the weight sync after the update gives them back.
  free_rollout_during_train: bool = False


@dataclasses.dataclass
class ControllerState:
  """Host-side state saved with every checkpoint."""

  step: int = 0
  version: int = 0


class Controller:
  """Runs synchronous GRPO steps; the stages come in through the constructor."""

  def __init__(
    self,
    *,
    settings: ControllerSettings,
    rollout: RolloutEngine,
    learner: Learner,
    weights: WeightStore,
    task: Task,
    tokenizer: Tokenizer,
    loader: Iterator,
    eval_records: Sequence[dict],
    writer: MetricsWriter,
    checkpointer: Checkpointer | None,
    show_progress: bool = True,
    backend: Backend,
    exporter: PolicyExporter | None = None,
  ):
    """`backend` made the learner and the store (`backends.Backend`); `exporter`, if any,
    writes the policy in Hugging Face layout when it is due."""
    self.s = settings
    self.backend = backend
    self.exporter = exporter
    self.rollout = rollout
    self.learner = learner
    self.weights = weights
    self.task = task
    self.tokenizer = tokenizer
    self.loader = loader
    self.eval_records = list(eval_records)
    self.writer = writer
    self.checkpointer = checkpointer
    self.show_progress = show_progress
    self.state = ControllerState()
    self.timeline = StageTimeline()
    backend.attach_learner(learner, self.timeline)  # a remote learner sends its spans here

  # -- weights -----------------------------------------------------------------------------------

  def publish(self) -> None:
    """Hands the learner's current weights to the store and the rollout engine."""
    start = time.time()
    self.weights.publish(self.learner.params, self.state.version)
    version, params = self.weights.latest()
    self.rollout.update_weights(params, version)
    jax.block_until_ready(self.rollout.params)
    for lane in (LEARNER_LANE, ROLLOUT_LANE):
      self.timeline.add(lane, start, time.time(), "weight-sync")

  # -- checkpoints -------------------------------------------------------------------------------

  def save(self) -> None:
    if self.checkpointer is not None:
      self.checkpointer.save(
        self.state.step,
        params=self.learner.params,
        opt_state=self.learner.opt_state,
        loader_state=self.loader.get_state(),
        controller_state=self.controller_state(),
      )

  def restore(self, step: int) -> None:
    restored = self.checkpointer.restore(
      step, params=self.learner.params, opt_state=self.learner.opt_state
    )
    self.learner.params = restored["params"]
    self.learner.opt_state = restored["opt_state"]
    self.loader.set_state(restored["loader"])
    self.load_controller_state(dict(restored["controller"]))

  def controller_state(self) -> dict:
    """The host-side state a checkpoint keeps (JSON-serialisable)."""
    return dataclasses.asdict(self.state)

  def load_controller_state(self, state: dict) -> None:
    self.state = ControllerState(**state)

  # -- one step ----------------------------------------------------------------------------------

  def encode_prompts(self, records: Sequence[dict]) -> list[list[int]]:
    return [encode_prompt(self.tokenizer, r, self.s.template_kwargs) for r in records]

  def score(self, records: Sequence[dict], completions) -> RewardBatch:
    """The task's rewards of the completions' text (the math task checks them in worker
    processes; a check that times out scores 0 and is counted in `timeouts`)."""
    texts = [self.tokenizer.decode(c.token_ids) for c in completions]
    batch = self.task.submit_rewards(records, texts).result()
    if batch.timeouts:
      log.warning(
        "Step %d: %d of %d reward checks timed out or crashed and scored 0.",
        self.state.step, batch.timeouts, len(texts),
      )  # fmt: skip
    return batch

  def generate_groups(self) -> tuple[list[dict], list, np.ndarray, dict[str, float]]:
    """One step's prompts, completions and rewards (`prompts_per_step` groups).

    With dynamic sampling, groups whose rewards are all equal are dropped and further prompt
    batches generated (up to `dynamic_sampling_rounds` rounds); a step still short after the
    last round is filled with dropped groups, which carry zero advantage.
    """
    s, step = self.s, self.state.step
    g = s.group_size
    kept, dropped = [], []
    times = {"time_rollout": 0.0, "time_reward": 0.0, "reward_timeouts": 0}
    for round_ in range(max(1, s.dynamic_sampling_rounds)):
      records = next(self.loader)
      group_records = [r for r in records for _ in range(g)]
      t = time.perf_counter()
      # Round 0 keeps the seed of a step without dynamic sampling.
      seed = _step_seed(s.seed, step) + round_ * 7919
      with self.timeline.span(ROLLOUT_LANE, "decode"):
        completions = self.rollout.generate(
          self.encode_prompts(group_records), s.sampling, seed=seed
        )
      times["time_rollout"] += time.perf_counter() - t
      t = time.perf_counter()
      scored = self.score(group_records, completions)
      rewards_b = scored.rewards_b
      times["reward_timeouts"] += scored.timeouts
      times["time_reward"] += time.perf_counter() - t
      for i in range(len(records)):
        group = (group_records[i * g : (i + 1) * g], completions[i * g : (i + 1) * g])
        rewards = rewards_b[i * g : (i + 1) * g]
        informative = not s.dynamic_sampling_rounds or rewards.std() > 0
        (kept if informative else dropped).append((*group, rewards))
      if len(kept) >= s.prompts_per_step:
        break
    filler = max(0, s.prompts_per_step - len(kept))
    groups = (kept + dropped[:filler])[: s.prompts_per_step]
    info = {}
    if s.dynamic_sampling_rounds:
      info = {
        "dynamic_rounds": round_ + 1,
        "groups_dropped": len(dropped),
        "groups_uninformative_in_batch": filler,
      }
    group_records = [r for recs, _, _ in groups for r in recs]
    completions = [c for _, comps, _ in groups for c in comps]
    rewards_b = np.concatenate([rewards for _, _, rewards in groups])
    return group_records, completions, rewards_b, times | info

  def step(self) -> dict[str, float]:
    """One synchronous RL step; returns its metrics (host floats)."""
    s, step = self.s, self.state.step
    group_records, completions, rewards_b, times = self.generate_groups()
    records = group_records[:: s.group_size]
    if s.free_rollout_during_train:
      self.rollout.release_memory()

    t = time.perf_counter()
    advantages_b = np.asarray(group_advantages(rewards_b, s.group_size, mode=s.advantage))
    batch = build_batch(completions, advantages_b, self.tokenizer.pad_id)
    times["time_reward"] += time.perf_counter() - t

    t = time.perf_counter()
    with self.timeline.span(LEARNER_LANE, "train"):
      train_metrics = jax.device_get(self.learner.update(batch))
    times["time_train"] = time.perf_counter() - t
    if train_metrics["skipped"]:
      log.warning(
        "Step %d: non-finite loss or gradient (loss=%s, grad_norm=%s) on the batch of "
        "prompts %s; the update was skipped.",
        step,
        train_metrics["loss"],
        train_metrics["grad_norm"],
        [r["id"] for r in records],
      )

    t = time.perf_counter()
    self.state.version += 1
    self.publish()
    times["time_weight_sync"] = time.perf_counter() - t
    self.state.step += 1

    metrics = {
      **batch_metrics(rewards_b, completions),
      "version": self.state.version,
      **{k: float(v) for k, v in train_metrics.items()},
      **times,
    }
    metrics["time_step"] = sum(v for k, v in times.items() if k.startswith("time_"))
    return metrics

  def evaluate(self) -> dict[str, float]:
    """On the held-out records, one response each: the mean reward (`eval_reward`) and the
    fraction answered correctly (`eval_pass_at_1`: pass@1 when decoding is greedy)."""
    completions = self.rollout.generate(
      self.encode_prompts(self.eval_records), self.s.eval_sampling, seed=_step_seed(self.s.seed, -1)
    )
    scored = self.score(self.eval_records, completions)
    return {
      "eval_reward": float(scored.rewards_b.mean()),
      "eval_pass_at_1": float(scored.correct_b.mean()),
      "eval_response_length": float(np.mean([len(c.token_ids) for c in completions])),
    }

  # -- the loop ----------------------------------------------------------------------------------

  def run(self) -> dict[str, float]:
    """Runs until `steps`; returns the first and last eval rewards of this call."""
    s = self.s
    self.publish()
    evals = {}
    if s.eval_every and self.state.step < s.steps:
      evals["eval_reward_start"] = self._eval_and_write()
    bar = self._progress_bar("GRPO")
    while self.state.step < s.steps:
      self._after_step(self.step(), bar, evals)
    bar.close()
    return evals

  def _progress_bar(self, desc: str) -> tqdm.tqdm:
    return tqdm.tqdm(
      total=self.s.steps,
      initial=self.state.step,
      desc=desc,
      unit="step",
      disable=not self.show_progress,
      dynamic_ncols=True,
    )

  def _after_step(self, metrics: dict[str, float], bar: tqdm.tqdm, evals: dict) -> None:
    """Writes a finished step's metrics, evaluates and checkpoints when due."""
    s = self.s
    self.writer.write(self.state.step, "train", metrics)
    postfix = {"reward": f"{metrics['reward_mean']:.3f}"}
    bar.update(1)
    last = self.state.step == s.steps
    if s.eval_every and (self.state.step % s.eval_every == 0 or last):
      evals["eval_reward_end"] = self._eval_and_write()
      postfix["eval"] = f"{evals['eval_reward_end']:.3f}"
    bar.set_postfix(postfix)
    if (s.checkpoint_every and self.state.step % s.checkpoint_every == 0) or last:
      self.save()
    out_dir = self.exporter and self.exporter.due(self.state.step, last)
    if out_dir:
      self.exporter.export(self.learner.params, out_dir)

  def _eval_and_write(self) -> float:
    """Evaluates, writes the eval record; returns its mean reward."""
    metrics = self.evaluate()
    self.writer.write(self.state.step, "eval", metrics)
    return metrics["eval_reward"]


def batch_metrics(rewards_b: np.ndarray, completions) -> dict[str, float]:
  """Reward and length statistics of a trained batch."""
  return {
    "reward_mean": float(rewards_b.mean()),
    "reward_std": float(rewards_b.std()),
    "response_length": float(np.mean([len(c.token_ids) for c in completions])),
    "truncated_frac": float(np.mean([c.finish_reason == "length" for c in completions])),
  }


def _step_seed(seed: int, step: int) -> int:
  """A sampling seed that depends only on (seed, step), so a resumed run samples the same."""
  return (seed * 1_000_003 + step + 1) % (2**31 - 1)
