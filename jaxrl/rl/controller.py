"""The synchronous RL controller: sample -> generate -> reward -> advantages -> update -> publish.

Every step runs the stages one after another on their own meshes and times each one, so the
metrics show where a step's time goes (rollout / reward / train / weight sync).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np
import tqdm

from jaxrl.config import ExperimentConfig
from jaxrl.data.prompts import encode_prompt
from jaxrl.data.tasks import RewardBatch, Task
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.metrics import MetricsWriter
from jaxrl.rl.backends import Backend, PolicyLearner, VersionedStore
from jaxrl.rl.checkpoint import Checkpointer
from jaxrl.rl.experience import build_batch
from jaxrl.rl.policy import PolicyExporter, template_kwargs, training_sampling
from jaxrl.rl.timeline import LEARNER_LANE, StageTimeline
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.train.advantages import group_advantages

log = logging.getLogger(__name__)

ROLLOUT_LANE = "rollout"  # the synchronous loop's rollout engine


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
    cfg: ExperimentConfig,
    rollout: RolloutEngine,
    learner: PolicyLearner,
    weights: VersionedStore,
    task: Task,
    tokenizer: Tokenizer,
    loader: Iterator,
    eval_records: Sequence[dict],
    writer: MetricsWriter,
    checkpointer: Checkpointer | None,
    show_progress: bool = True,
    backend: Backend,
    exporter: PolicyExporter | None = None,
    free_rollout_during_train: bool = False,
  ):
    """`cfg`: the run's config (the loop reads its settings there); `backend` made the learner
    and the store (`backends.Backend`); `exporter`, if any, writes the policy in Hugging Face
    layout when it is due; `free_rollout_during_train`: drop the rollout engine's weights and
    cache during each update (it shares the learner's devices; the weight sync after the
    update gives them back)."""
    self.cfg = cfg
    self.sampling = training_sampling(cfg, tokenizer)
    self.eval_sampling = dataclasses.replace(self.sampling, temperature=cfg.eval.temperature)
    self.chat = template_kwargs(cfg)  # chat-template variables of every prompt
    self.free_rollout_during_train = free_rollout_during_train
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
    """Hands the learner's current weights to the store and the rollout engine. They are lent
    (`weights.py`'s ownership rule): the engine takes them now, before the next update, and
    the learner recalls them from the store before it donates them."""
    start = time.time()
    self.learner.publish_to(self.weights, self.state.version, lend=True)
    self.weights.wait_for(self.state.version)  # a learner in other processes publishes there
    version, params = self.weights.pull(-1)
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
    return [encode_prompt(self.tokenizer, r, self.chat) for r in records]

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
    cfg, step = self.cfg, self.state.step
    g, wanted = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    rounds = cfg.rollout.dynamic_sampling_rounds if cfg.rollout.dynamic_sampling else 0
    kept, dropped = [], []
    times = {"time_rollout": 0.0, "time_reward": 0.0, "reward_timeouts": 0}
    for round_ in range(max(1, rounds)):
      records = next(self.loader)
      group_records = [r for r in records for _ in range(g)]
      t = time.perf_counter()
      # Round 0 keeps the seed of a step without dynamic sampling.
      seed = _step_seed(cfg.seed, step) + round_ * 7919
      with self.timeline.span(ROLLOUT_LANE, "decode"):
        completions = self.rollout.generate(
          self.encode_prompts(group_records), self.sampling, seed=seed
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
        informative = not rounds or rewards.std() > 0
        (kept if informative else dropped).append((*group, rewards))
      if len(kept) >= wanted:
        break
    filler = max(0, wanted - len(kept))
    groups = (kept + dropped[:filler])[:wanted]
    info = {}
    if rounds:
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
    g, step = self.cfg.rollout.group_size, self.state.step
    group_records, completions, rewards_b, times = self.generate_groups()
    records = group_records[::g]
    if self.free_rollout_during_train:
      self.rollout.release_memory()

    t = time.perf_counter()
    advantages_b = np.asarray(group_advantages(rewards_b, g, mode=self.cfg.train.advantage))
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
      self.encode_prompts(self.eval_records), self.eval_sampling, seed=_step_seed(self.cfg.seed, -1)
    )
    scored = self.score(self.eval_records, completions)
    return {
      "eval_reward": float(scored.rewards_b.mean()),
      "eval_pass_at_1": float(scored.correct_b.mean()),
      "eval_response_length": float(np.mean([len(c.token_ids) for c in completions])),
    }

  # -- the loop ----------------------------------------------------------------------------------

  def run(self, until: int | None = None) -> dict[str, float]:
    """Runs until step `until` (default `config.train.steps`); returns the first and last eval
    rewards of this call."""
    steps = self.cfg.train.steps if until is None else until
    self.publish()
    evals = {}
    if self.cfg.eval.every and self.state.step < steps:
      evals["eval_reward_start"] = self._eval_and_write()
    bar = self._progress_bar("GRPO")
    while self.state.step < steps:
      self._after_step(self.step(), bar, evals)
    bar.close()
    return evals

  def _progress_bar(self, desc: str) -> tqdm.tqdm:
    return tqdm.tqdm(
      total=self.cfg.train.steps,
      initial=self.state.step,
      desc=desc,
      unit="step",
      disable=not self.show_progress,
      dynamic_ncols=True,
    )

  def _after_step(self, metrics: dict[str, float], bar: tqdm.tqdm, evals: dict) -> None:
    """Writes a finished step's metrics, evaluates and checkpoints when due."""
    cfg = self.cfg
    self.writer.write(self.state.step, "train", metrics)
    postfix = {"reward": f"{metrics['reward_mean']:.3f}"}
    bar.update(1)
    last = self.state.step == cfg.train.steps
    if cfg.eval.every and (self.state.step % cfg.eval.every == 0 or last):
      evals["eval_reward_end"] = self._eval_and_write()
      postfix["eval"] = f"{evals['eval_reward_end']:.3f}"
    bar.set_postfix(postfix)
    if (cfg.checkpoint.every and self.state.step % cfg.checkpoint.every == 0) or last:
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
