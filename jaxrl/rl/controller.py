"""The RL controller: rollout workers generate groups, the learner trains on them, the weight
store carries each new version back. One loop for every backend and both modes.

Groups (a prompt and its `group_size` responses) are released in loader order under admission
control: group k may start only once k < (version + max_staleness + 1) x prompts_per_step, and
a group's *version* is the learner's version when it was released. Workers (`workers.py`) never
decode a group's requests with weights older than its version, so every token of a sample is at
least that version. The learner takes finished groups oldest version first (then in the order
they finished) and waits while skipping an unfinished old group would leave it no step at which
it could still be trained within the bound (`scheduler/staleness.py`, which the simulator runs
too), so no trained token is more than `max_staleness` versions older than the weights it is
trained on. The synchronous loop (`config.loop.mode='sync'`) is the bound 0: a step's groups are
released, generated and trained, then the next step's, and the learner lends the store its live
weights (no copy: nothing decodes while it trains; `weights.py`'s ownership rule). With
`config.rollout.dynamic_sampling` a group whose rewards are all equal is dropped and another
prompt released in its place, up to (dynamic_sampling_rounds - 1) x prompts_per_step per step;
past that budget such groups are trained (they carry zero advantage).

The controller keeps the last streamed copy of every request; it is the single source of truth
for what has been generated. A worker leaving with notice hands its records back; a worker
that dies without notice has its requests re-dispatched from those copies; a checkpoint stores
them with the released-but-untrained groups, so a resumed job loses no sample and skips or
repeats no prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
import tqdm

from jaxrl.config import ExperimentConfig
from jaxrl.data.prompts import encode_prompt
from jaxrl.data.task_base import RewardBatch, Task
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.metrics import MetricsWriter
from jaxrl.rl.backends import Backend, PolicyLearner, VersionedStore
from jaxrl.rl.checkpoint import Checkpointer
from jaxrl.rl.controller_checkpoint import CheckpointedController, ControllerState
from jaxrl.rl.dispatch import LengthPredictor
from jaxrl.rl.episodes import EnvEvent, EpisodeDriver, episode_metrics, trajectory_max_tokens
from jaxrl.rl.experience import build_batch
from jaxrl.rl.groups import Group, batch_metrics, parse_request_id, request_id, sampling_seed
from jaxrl.rl.policy import PolicyExporter, template_kwargs, training_sampling
from jaxrl.rl.timeline import LEARNER_LANE, StageTimeline
from jaxrl.rl.worker_pool import WorkerPool
from jaxrl.rl.workers import Assignment, copy_record
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.requests import (
  RequestRecord,
  longest_cached,
  pages_for,
  record_completion,
)
from jaxrl.scheduler.staleness import admission_cap, choose_batch
from jaxrl.train.advantages import group_advantages

log = logging.getLogger(__name__)


class Controller(CheckpointedController, WorkerPool):
  """The RL loop: rollout on workers (threads or Ray actors), the learner on the calling thread.

  `self.rollout` (an engine on the learner's mesh) serves only evaluation. Workers come from
  the backend when `run` starts; `add_worker` adds one (before or during `run`),
  `remove_worker` gives one a preemption notice and `kill_worker` kills one without notice.
  `hooks` run once per loop iteration, `on_train` after each update, `on_step` once a step's
  metrics are written (tests and benchmarks use them to inject faults and follow the run).
  """

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
    backend: Backend,
    show_progress: bool = True,
    exporter: PolicyExporter | None = None,
    free_rollout_during_train: bool = False,
  ):
    """`cfg`: the run's config, its loop mode resolved (`job.resolve_loop_mode`); the loop reads
    its settings there. `backend` made the learner and the store and makes the rollout workers
    (`backends.Backend`): one per worker slot when a call of `run` starts. `exporter`, if any,
    writes the policy in Hugging Face layout when due. `free_rollout_during_train`: the stages
    share devices, so the workers' engines (and the eval engine after evaluating) drop their
    weights and KV pages while the learner trains (sync mode only, where nothing decodes then)."""
    self.cfg = cfg
    self._kl = cfg.train.loss.kl_weight > 0  # checkpoints then hold the KL reference too
    self.loop = cfg.loop
    self.sampling = training_sampling(cfg, tokenizer)
    self.eval_sampling = dataclasses.replace(self.sampling, temperature=cfg.eval.temperature)
    self.chat = template_kwargs(cfg)  # chat-template variables of every prompt
    sync = cfg.loop.mode == "sync"
    self.free_rollout_during_train = free_rollout_during_train and sync
    self.exporter = exporter
    self.rollout = rollout
    # The rollout engines' parameter dtypes: a copy published for them is cast to these first.
    self.reader_dtypes = jax.tree.map(lambda a: a.dtype, rollout.model.abstract_params())
    self.learner = learner
    self.task = task
    self.tokenizer = tokenizer
    self.loader = loader
    self.eval_records = list(eval_records)
    self.writer = writer
    self.checkpointer = checkpointer
    self.show_progress = show_progress
    self.state = ControllerState()
    timeline = StageTimeline()
    backend.attach_learner(learner, timeline)  # a remote learner sends its spans here
    self.groups: dict[int, Group] = {}
    self.ready: list[int] = []  # finished, untrained groups in the order they finished
    self.next_group = 0
    self.prompts: collections.deque[dict] = collections.deque()  # drawn, not yet released
    self.replacements = 0  # groups released in place of dropped ones (dynamic sampling)
    self.dropped_this_step = 0
    self.hooks: list[Callable[[Controller], None]] = []
    self.on_train: list[Callable[[int, list[Group]], None]] = []
    self.on_step: list[Callable[[Controller], None]] = []  # after a step's metrics are written
    self.lengths = LengthPredictor(default=self.sampling.max_new_tokens / 2)
    self._eval_version = -1
    self._reward_s = 0.0  # scoring time since the last step
    self._reward_timeouts = 0  # reward checks that timed out since the last step
    self._env_failures = 0  # groups in a row whose environments could not start
    super().__init__(
      backend,
      weights,
      timeline,
      max_staleness=0 if sync else cfg.loop.max_staleness,
      skew_aware_dispatch=cfg.loop.skew_aware_dispatch,
      measured_rates=cfg.loop.measured_rates,
      worker_restarts=cfg.loop.worker_restarts,
      no_worker_timeout_s=cfg.loop.no_worker_timeout_s,
    )
    # Multi-turn runs: each response is an episode of `config.env` (`episodes.py`).
    self.episodes = None
    if cfg.env.name:
      self.episodes = EpisodeDriver(
        cfg,
        tokenizer,
        self.sampling,
        self.events,
        max_tokens=trajectory_max_tokens(cfg, rollout.model.config.max_seq_len),
        template_kwargs=self.chat,
      )

  # -- requests (what `WorkerPool` asks of its controller) ---------------------------------------

  def _assignment(self, rid: str) -> Assignment:
    gid, j = parse_request_id(rid)
    group = self.groups[gid]
    # A copy: the worker's engine appends to its record while the controller keeps its own.
    return Assignment(copy_record(group.records[j]), group.version)

  def _take_record(self, rid: str, record: RequestRecord, finished: bool) -> None:
    gid, j = parse_request_id(rid)
    group = self.groups[gid]
    group.records[j] = record
    if not finished:
      return
    if group.episodes is not None:  # a turn ended: the environment takes it from here
      if self.episodes.turn_ended(group, j, record):
        self._response_done(group, j)
      return
    self._response_done(group, j)

  def _response_done(self, group: Group, j: int) -> None:
    group.done[j] = True
    if group.episodes is not None:  # its episode ended: no next turn reuses its kept pages
      self._drop_kept(request_id(group.gid, j))
    if group.finished:
      self.lengths.update(group.prompt["id"], [len(r.token_ids) for r in group.records])
      self._score(group)

  def _on_event(self, ev) -> None:
    if isinstance(ev, EnvEvent):  # an environment call ended (`episodes.py`)
      self._on_env_event(ev)
    else:
      super()._on_event(ev)

  def _on_env_event(self, ev: EnvEvent) -> None:
    group = self.groups.get(ev.gid)
    if group is None:
      return  # dropped meanwhile
    outcome = self.episodes.on_event(ev, group)
    self._env_failures = self._env_failures + 1 if outcome.failed is not None else 0
    if self._env_failures > max(64, 4 * self.cfg.rollout.prompts_per_step):
      raise RuntimeError(
        f"The last {self._env_failures} groups' environments (config.env.name="
        f"{self.cfg.env.name!r}) could not start, on records of config.task.name="
        f"{self.cfg.task.name!r}; the last: {outcome.failed}. Fix the records or the task."
      )
    if outcome.failed is not None:
      # No trajectory of the group has a turn yet: another prompt goes in its place.
      log.warning(
        "Record %r skipped: its environment could not start: %s",
        group.prompt.get("id", "?"), outcome.failed,
      )  # fmt: skip
      del self.groups[group.gid]
      self.replacements += 1
      self.counters["groups_env_failed"] += 1
      self._release()
      return
    self.pending.extend(request_id(group.gid, j) for j in outcome.queued)
    for j in outcome.ended:
      self._response_done(group, j)

  def _tokens_so_far(self, rid: str) -> int:
    gid, j = parse_request_id(rid)
    return len(self.groups[gid].records[j].token_ids)

  def _predicted_left(self, rid: str) -> float:
    """Tokens the request is predicted still to generate (at least 1)."""
    gid, j = parse_request_id(rid)
    group = self.groups[gid]
    return max(1.0, self.lengths.predict(group.prompt["id"]) - len(group.records[j].token_ids))

  # -- rewards -----------------------------------------------------------------------------------

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

  def _score(self, group: Group, may_drop: bool = True) -> None:
    """Scores a finished group; it is ready to train, or (dynamic sampling, rewards all equal,
    budget left) dropped and another prompt released in its place."""
    if group.episodes is not None:  # the environment's rewards, summed over each episode
      group.rewards = np.asarray([t.reward for t in group.trajectories], np.float32)
    else:
      start = time.perf_counter()
      completions = [record_completion(r) for r in group.records]
      scored = self.score([group.prompt] * len(completions), completions)
      self._reward_s += time.perf_counter() - start
      group.rewards = scored.rewards_b
      self.counters["reward_timeouts"] += scored.timeouts
      self._reward_timeouts += scored.timeouts
    rollout = self.cfg.rollout
    budget = (rollout.dynamic_sampling_rounds - 1) * rollout.prompts_per_step
    uninformative = np.ptp(group.rewards) == 0
    if may_drop and rollout.dynamic_sampling and uninformative and self.dropped_this_step < budget:
      del self.groups[group.gid]
      self.dropped_this_step += 1
      self.replacements += 1
      self.counters["groups_dropped"] += 1
      self._release()
      return
    self.ready.append(group.gid)

  # -- admission and dispatch --------------------------------------------------------------------

  def _release(self) -> None:
    """Starts the groups admission control allows: k < (version + eta + 1) x batch, plus one
    for every group dynamic sampling dropped."""
    g = self.cfg.rollout.group_size
    cap = admission_cap(self.state.version, self.max_staleness, self.cfg.rollout.prompts_per_step)
    cap += self.replacements
    released = []
    while self.next_group < cap:
      if not self.prompts:  # the loader gives a step's prompts at a time
        self.prompts.extend(next(self.loader))
      prompt = self.prompts.popleft()
      ids = [] if self.episodes is not None else self.encode_prompts([prompt])[0]
      too_long = self._too_long(len(ids))
      if too_long:
        self._skip_long_prompt(prompt, len(ids), too_long)
        continue
      gid = self.next_group
      self.next_group += 1
      records = [
        RequestRecord(
          request_id=request_id(gid, j),
          prompt_ids=ids,
          sampling=self.sampling,
          seed=sampling_seed(self.cfg.seed, gid * g + j),
        )
        for j in range(g)
      ]
      group = Group(gid, prompt, self.state.version, records, [False] * len(records))
      self.groups[gid] = group
      if self.episodes is not None:  # queued once their environments are reset
        self.episodes.start(group)
      else:
        released += [r.request_id for r in records]
    if self.loop.skew_aware_dispatch:
      # Longest predicted first; stable, so release order breaks ties.
      released.sort(key=lambda rid: -self._predicted_left(rid))
    self.pending.extend(released)

  # -- training ----------------------------------------------------------------------------------

  def _too_long(self, length: int) -> str:
    """Why a prompt of `length` ids can never run (the workers would refuse it and crash,
    again and again, until the run stops), or "". The job refuses a page budget too small
    for its longest sampled prompt (`job.build_controller`); this catches a longer one."""
    max_seq_len = self.rollout.model.config.max_seq_len
    if length >= max_seq_len:
      return f"no fewer than the model's max_seq_len={max_seq_len}"
    paged = self.rollout.cfg  # the workers' page settings, as the eval engine's
    cached = longest_cached(length, self.sampling.max_new_tokens, max_seq_len)
    if pages_for(cached, paged.page_size) > paged.num_pages:
      return (
        f"with its response more than config.rollout.paged.num_pages={paged.num_pages} pages "
        f"of {paged.page_size} hold"
      )
    return ""

  def _skip_long_prompt(self, prompt: dict, length: int, why: str) -> None:
    self.counters["prompts_too_long"] += 1
    log.warning(
      "Skipped a training prompt of %d tokens, %s (%d skipped so far): %.80r",
      length, why, self.counters["prompts_too_long"], prompt.get("prompt", prompt),
    )  # fmt: skip

  def _choose_batch(self) -> list[Group] | None:
    """The groups of the next step, or None while the learner must wait (`choose_batch`)."""
    ready = [(gid, self.groups[gid].version) for gid in self.ready]
    waiting = set(self.ready)
    in_flight = [g.version for gid, g in self.groups.items() if gid not in waiting]
    choice = choose_batch(
      ready, in_flight, self.state.version, self.max_staleness, self.cfg.rollout.prompts_per_step
    )
    if choice is None:
      return None
    if choice.forced:
      log.warning(
        "Step %d trains although a group left over cannot be trained within max_staleness=%d "
        "(nothing is in flight to wait for).", self.state.step, self.max_staleness,
      )  # fmt: skip
    return [self.groups[gid] for gid in choice.groups]

  def _train(self, groups: list[Group]) -> dict[str, float]:
    v, eta = self.state.version, self.max_staleness
    for g in groups:
      if v - g.oldest_version() > eta:
        raise RuntimeError(
          f"Group {g.gid} has a token of version {g.oldest_version()} at learner version {v}, "
          f"beyond max_staleness={eta}; admission control is broken."
        )
    rewards_b = np.concatenate([g.rewards for g in groups])
    advantages_b = np.asarray(
      group_advantages(rewards_b, self.cfg.rollout.group_size, mode=self.cfg.train.advantage)
    )
    if self.episodes is not None:  # advantages over whole trajectories
      trajectories = [t for g in groups for t in g.trajectories]
      batch = self.episodes.batch(trajectories, advantages_b)
      versions = [t.sampled_versions for t in trajectories]
      sample_metrics = episode_metrics(trajectories)
    else:
      completions = [record_completion(r) for g in groups for r in g.records]
      batch = build_batch(completions, advantages_b, self.tokenizer.pad_id)
      versions = [np.asarray(c.versions) for c in completions]
      sample_metrics = batch_metrics(rewards_b, completions)
    if self.free_rollout_during_train:
      for worker in self.workers.values():
        worker.release_memory()
    start = time.perf_counter()
    with self.timeline.span(LEARNER_LANE, "train"):
      train_metrics = jax.device_get(self.learner.update(batch))
    time_train = time.perf_counter() - start
    if train_metrics["skipped"]:
      log.warning(
        "Step %d: non-finite loss or gradient (loss=%s, grad_norm=%s) on the batch of "
        "prompts %s; the update was skipped.",
        self.state.step, train_metrics["loss"], train_metrics["grad_norm"],
        [g.prompt["id"] for g in groups],
      )  # fmt: skip
    for hook in self.on_train:
      hook(self.state.step, groups)
    for g in groups:
      del self.groups[g.gid]
    chosen = {g.gid for g in groups}
    self.ready = [gid for gid in self.ready if gid not in chosen]

    start = time.perf_counter()
    self.state.version += 1
    self.state.step += 1
    self.publish()
    self._release()
    time_publish = time.perf_counter() - start

    lags = np.concatenate([v - vs for vs in versions])
    sample_lag = np.array([v - int(vs.min()) for vs in versions if len(vs)])
    metrics = {
      **sample_metrics,
      "version": self.state.version,
      "off_policy_token_frac": float(np.mean(lags > 0)),
      "staleness_mean": float(sample_lag.mean()),
      **{f"staleness_{k}": float(np.mean(sample_lag == k)) for k in range(eta + 1)},
      "time_train": time_train,
      "time_weight_sync": time_publish,
      "workers": len(self.workers),
      **{k: float(v) for k, v in train_metrics.items()},
    }
    if self.cfg.rollout.dynamic_sampling:
      metrics["groups_dropped"] = self.dropped_this_step
      metrics["groups_uninformative_in_batch"] = sum(np.ptp(g.rewards) == 0 for g in groups)
      self.dropped_this_step = 0
    return metrics

  # -- weights -----------------------------------------------------------------------------------

  def publish(self) -> None:
    """Publishes the learner's weights and tells the workers the oldest version they may still
    generate with. Async: a copy in the rollout's dtype (workers pull while the learner trains),
    kept on the training devices (`loop.publish_on_device`) or on the host. Sync: the live
    buffers, lent (nothing decodes while the learner trains, and its next update recalls them
    first). A learner in another process may publish from there in the background (the span
    here is then the hand-off); a worker that needs the version waits for it."""
    with self.timeline.span(LEARNER_LANE, "weight-sync"):
      self.learner.publish_to(
        self.weights,
        self.state.version,
        lend=self.max_staleness == 0,
        dtypes=self.reader_dtypes,
        on_device=self.cfg.loop.publish_on_device,
      )
    self.set_min_version(self.state.version - self.max_staleness)

  # -- evaluation --------------------------------------------------------------------------------

  def evaluate(self) -> dict[str, float]:
    """On the held-out records, one response each: the mean reward (`eval_reward`) and the
    fraction answered correctly (`eval_pass_at_1`: pass@1 when decoding is greedy)."""
    if self._eval_version != self.state.version:
      self.rollout.update_weights(self.learner.params, self.state.version)
      self._eval_version = self.state.version
    seed = sampling_seed(self.cfg.seed, -1)
    if self.episodes is not None:
      metrics = self.episodes.evaluate(self.rollout, self.eval_records, self.eval_sampling, seed)
    else:
      prompts = self.encode_prompts(self.eval_records)
      completions = self.rollout.generate(prompts, self.eval_sampling, seed=seed)
    if self.free_rollout_during_train:
      self.rollout.release_memory()
      self._eval_version = -1
    if self.episodes is not None:
      return metrics
    scored = self.score(self.eval_records, completions)
    return {
      "eval_reward": float(scored.rewards_b.mean()),
      "eval_pass_at_1": float(scored.correct_b.mean()),
      "eval_response_length": float(np.mean([len(c.token_ids) for c in completions])),
    }

  def _eval_and_write(self) -> float:
    """Evaluates, writes the eval record; returns its mean reward (a resumed run's, written
    before the checkpoint it resumed from, where there is one)."""
    if recorded := self.writer.recorded("eval", self.state.step):
      return recorded["eval_reward"]
    metrics = self.evaluate()
    self.writer.write(self.state.step, "eval", metrics)
    return metrics["eval_reward"]

  def close(self) -> None:
    """Closes what the controller holds open: the task (the math task's answer-checking
    processes), the environments' threads, the metrics writer (TensorBoard's writer: a thread
    and a pipe) and the checkpoint manager. The controller cannot run after; its metrics stay
    readable at `writer.path`. The learner's threads compiling ahead skip what they have not
    begun (rollout workers' engines stop theirs when the workers stop)."""
    self.learner.stop_compiling_ahead()
    self.task.close()
    if self.episodes is not None:
      self.episodes.close()
    self.writer.close()
    self.checkpointer.close()

  # -- the loop ----------------------------------------------------------------------------------

  def run(self, until: int | None = None) -> dict[str, float]:
    """Runs until step `until` (default `config.train.steps`); returns the first and last eval
    rewards of this call.

    Workers are stopped on return (and on an exception): their unfinished requests stay in
    the controller's state as the records they last streamed.
    """
    steps = self.cfg.train.steps if until is None else until
    self.min_version = self.state.version - self.max_staleness
    if self.weights.version < self.state.version:  # a later call of run has published it
      self.publish()
    self._release()
    if not self.initial_workers and not self.workers:
      self.initial_workers = self.fresh_workers()
    for worker in self.initial_workers:
      self.add_worker(worker)
    self.initial_workers = []
    if not self.workers and self.state.step < steps:
      raise RuntimeError(
        "Controller.run has no rollout workers; add some with add_worker(make_worker(...))."
      )
    evals = {}
    if self.cfg.eval.every and self.state.step < steps:
      evals["eval_reward_start"] = self._eval_and_write()
    bar = tqdm.tqdm(
      total=self.cfg.train.steps,
      initial=self.state.step,
      desc=f"GRPO {self.loop.mode}",
      unit="step",
      disable=not self.show_progress,
      dynamic_ncols=True,
    )
    try:
      wait_start = time.perf_counter()
      while self.state.step < steps:
        for hook in self.hooks:
          hook(self)
        self._dispatch()  # what was released since: before waiting for the workers' events
        self._handle_events(block=True)
        self.backend.raise_if_lost(self.learner, self.weights)
        self._check_workers()
        self.follow_cluster()
        self.check_workers_left()
        self._dispatch()
        groups = self._choose_batch()
        if groups is None:
          continue
        time_wait = time.perf_counter() - wait_start
        time_reward, self._reward_s = self._reward_s, 0.0
        metrics = self._train(groups)
        metrics["time_wait"] = time_wait
        metrics["time_reward"] = time_reward
        metrics["reward_timeouts"], self._reward_timeouts = self._reward_timeouts, 0
        metrics["time_step"] = time.perf_counter() - wait_start
        self._after_step(metrics, bar, evals)  # eval and checkpoint: not learner idle time
        wait_start = time.perf_counter()
    finally:
      bar.close()
      self.stop_workers()
    self.weights.wait_for(self.state.version)  # a later `run` finds the store up to date
    return evals

  def _after_step(self, metrics: dict[str, float], bar: tqdm.tqdm, evals: dict) -> None:
    """Writes a finished step's metrics, evaluates and checkpoints when due."""
    cfg = self.cfg
    self.writer.write(self.state.step, "train", metrics)
    for hook in self.on_step:
      hook(self)
    postfix = {"reward": f"{metrics['reward_mean']:.3f}"}
    bar.update(1)
    last = self.state.step == cfg.train.steps
    if cfg.eval.every and (self.state.step % cfg.eval.every == 0 or last):
      evals["eval_reward_end"] = self._eval_and_write()
      postfix["eval"] = f"{evals['eval_reward_end']:.3f}"
    bar.set_postfix(postfix)
    # Export first: a checkpoint then implies its step's export, so a run killed while
    # exporting (the final one included) exports again when it resumes.
    out_dir = self.exporter and self.exporter.due(self.state.step, last)
    if out_dir:
      self.exporter.export(self.learner.params, out_dir)
    if (cfg.checkpoint.every and self.state.step % cfg.checkpoint.every == 0) or last:
      self.save()
