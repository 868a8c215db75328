"""The asynchronous RL controller: rollout workers generate while the learner trains.

Groups (a prompt and its `group_size` responses) are released in loader order under admission
control: group k may start only once k < (version + max_staleness + 1) x prompts_per_step, and
a group's *version* is the learner's version when it was released. Workers (`workers.py`) never
decode a group's requests with weights older than its version, so every token of a sample is at
least that version. The learner takes finished groups oldest version first (then in the order
they finished) and waits while skipping an unfinished old group would leave it no step at which
it could still be trained within the bound, so no trained token is more than `max_staleness`
versions older than the weights it is trained on. max_staleness = 0 is the synchronous loop.

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
import queue
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.rl.backends import Backend
from jaxrl.rl.controller import Controller, _step_seed, batch_metrics
from jaxrl.rl.dispatch import LengthPredictor, WorkerRates
from jaxrl.rl.experience import build_batch
from jaxrl.rl.timeline import LEARNER_LANE
from jaxrl.rl.workers import Assignment, RolloutWorker, WorkerEvent, copy_record
from jaxrl.rollout.requests import RequestRecord, record_completion
from jaxrl.scheduler.staleness import admission_cap, choose_batch
from jaxrl.train.advantages import group_advantages

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Group:
  """A prompt's responses as the controller last saw them."""

  gid: int
  prompt: dict
  version: int  # the learner's version when the group was released
  records: list[RequestRecord]
  done: list[bool]
  rewards: np.ndarray | None = None

  @property
  def finished(self) -> bool:
    return all(self.done)

  def oldest_version(self) -> int:
    return min((min(r.versions) for r in self.records if r.versions), default=self.version)

  def to_dict(self) -> dict:
    return {
      "gid": self.gid,
      "prompt": self.prompt,
      "version": self.version,
      "records": [r.to_dict() for r in self.records],
      "done": list(self.done),
    }

  @classmethod
  def from_dict(cls, d: dict) -> Group:
    return cls(
      gid=d["gid"],
      prompt=d["prompt"],
      version=d["version"],
      records=[RequestRecord.from_dict(r) for r in d["records"]],
      done=list(d["done"]),
    )


def request_id(gid: int, j: int) -> str:
  return f"g{gid}.{j}"


def parse_request_id(rid: str) -> tuple[int, int]:
  gid, j = rid[1:].split(".")
  return int(gid), int(j)


class AsyncController(Controller):
  """The RL loop with rollout on worker threads and the learner on the calling thread.

  `self.rollout` (an engine on the learner's mesh) serves only evaluation. Workers are added
  with `add_worker` (before or during `run`); `remove_worker` gives one a preemption notice and
  `kill_worker` kills one without notice. `hooks` run once per controller iteration (tests use
  them to inject faults).
  """

  POLL_S = 0.05  # how long the loop waits for a worker event before checking on its workers

  def __init__(self, *, backend: Backend, **kwargs):
    """`backend` makes the rollout workers (`backends.Backend`): one per worker slot when a
    call of `run` starts, and any added later (`make_worker`). The loop's settings are read
    from `config.loop` (`max_staleness`, `skew_aware_dispatch`, `measured_rates`; the backend
    gives the workers `partial_rollouts`)."""
    super().__init__(backend=backend, **kwargs)
    self.loop = self.cfg.loop
    self.events: queue.Queue[WorkerEvent] = queue.Queue()
    self.workers: dict[str, RolloutWorker] = {}
    self.leaving: set[str] = set()  # given notice, not gone yet: nothing new is sent to them
    self.groups: dict[int, Group] = {}
    self.ready: list[int] = []  # finished, untrained groups in the order they finished
    self.pending: collections.deque[str] = collections.deque()  # request ids to dispatch
    self.assigned: dict[str, str] = {}  # request id -> worker
    self.next_group = 0
    self.hooks: list[Callable[[AsyncController], None]] = []
    self.on_train: list[Callable[[int, list[Group]], None]] = []
    self.counters = collections.Counter()
    self.rollout_busy_s = 0.0  # decode time of the workers that have left
    self.lengths = LengthPredictor(default=self.sampling.max_new_tokens / 2)
    self.rates = WorkerRates(min_work=8, measured=self.loop.measured_rates)
    self.split: dict[str, float] = {}  # worker -> share of the rollout work (`_replan_split`)
    # worker -> (time of its last event or first assignment, whether it held requests then)
    self._worker_clock: dict[str, tuple[float, bool]] = {}
    self._eval_version = -1
    # The workers the next `run` starts with (each call of `run` stops its workers on return;
    # the next one makes a fresh set).
    self._worker_slots = backend.worker_slots()
    self.initial_workers: list[RolloutWorker] = self.fresh_workers()

  # -- workers -----------------------------------------------------------------------------------

  def make_worker(self, name: str, devices=None) -> RolloutWorker:
    """A new worker from the backend, pulling from this controller's store (`devices`: where
    a local worker runs; a Ray worker's actor finds its own)."""
    return self.backend.make_worker(name, devices, self.weights)

  def fresh_workers(self) -> list[RolloutWorker]:
    """One new worker per slot of the backend (`config.loop.rollout_workers`)."""
    return [self.make_worker(f"w{i}", d) for i, d in enumerate(self._worker_slots)]

  def add_worker(self, worker: RolloutWorker) -> None:
    """Registers and starts a worker; it provisions itself by pulling the newest weights."""
    if worker.name in self.workers:
      raise ValueError(f"A worker named {worker.name!r} is already running.")
    worker.attach(self.events, self.timeline)
    self.workers[worker.name] = worker
    worker.set_min_version(self.state.version - self.loop.max_staleness)
    worker.start()
    self.counters["workers_added"] += 1
    self.rates.add(worker.name, worker.predicted_tokens_per_s)
    self._replan_split()

  def remove_worker(self, name: str) -> None:
    """A preemption notice: the worker hands back its requests and leaves (asynchronously)."""
    self.leaving.add(name)
    self.workers[name].preempt()

  def kill_worker(self, name: str) -> None:
    """Kills a worker without notice; its requests continue elsewhere from their last
    streamed tokens."""
    worker = self.workers[name]
    worker.kill()
    worker.join()
    self._handle_events(block=False)
    self._drop_worker(name, "killed")

  def _drop_worker(self, name: str, why: str) -> None:
    self.leaving.discard(name)
    worker = self.workers.pop(name, None)
    if worker is None:
      return
    self.rollout_busy_s += worker.busy_s
    self.rates.remove(name)
    self._worker_clock.pop(name, None)
    self._replan_split()
    lost = [rid for rid, w in self.assigned.items() if w == name]
    for rid in lost:
      del self.assigned[rid]
    self.pending.extendleft(reversed(lost))
    self.counters[f"workers_{why}"] += 1
    self.counters["requests_redispatched"] += len(lost)
    self.counters["tokens_kept_on_redispatch"] += sum(
      len(self.groups[gid].records[j].token_ids) for gid, j in map(parse_request_id, lost)
    )
    log.info("Rollout worker %s %s; %d requests go back to the queue.", name, why, len(lost))

  # -- events ------------------------------------------------------------------------------------

  def _handle_events(self, block: bool) -> None:
    try:
      event = self.events.get(timeout=self.POLL_S) if block else self.events.get_nowait()
    except queue.Empty:
      return
    while True:
      self._on_event(event)
      try:
        event = self.events.get_nowait()
      except queue.Empty:
        return

  def _on_event(self, ev: WorkerEvent) -> None:
    if ev.worker not in self.workers:
      return  # a late event of a worker already dropped: its requests went elsewhere
    if ev.kind == "crashed":
      log.warning("Rollout worker %s crashed: %s", ev.worker, ev.detail)
      self._drop_worker(ev.worker, "crashed")
      return
    if ev.kind == "store_unreachable":
      # Its weights are too old to generate with and it cannot get newer ones: withdraw it so
      # its requests continue elsewhere. It may be added again once the store is reachable.
      self.counters["store_unreachable"] += 1
      log.warning(
        "Rollout worker %s cannot reach the weight store (%s); withdrawing it.",
        ev.worker,
        ev.detail,
      )
      self.remove_worker(ev.worker)
      return
    for record in ev.records:
      rid = record.request_id
      if self.assigned.get(rid) != ev.worker:
        continue  # re-dispatched meanwhile
      gid, j = parse_request_id(rid)
      group = self.groups[gid]
      group.records[j] = record
      if ev.kind == "finished":
        del self.assigned[rid]
        group.done[j] = True
        if group.finished:
          self.lengths.update(group.prompt["id"], [len(r.token_ids) for r in group.records])
          self._score(group)
      elif ev.kind == "left":
        del self.assigned[rid]
        self.pending.appendleft(rid)
        self.counters["requests_handed_back"] += 1
        self.counters["tokens_kept_on_redispatch"] += len(record.token_ids)
    if ev.kind == "left":
      self._drop_worker(ev.worker, "preempted")
      return
    # A worker streams one "progress" event per decode window: its rate of windows, unlike its
    # rate of tokens, does not grow with the work it is given (which would draw ever more work
    # to whichever worker happened to get more).
    self._observe_rate(ev.worker, 1 if ev.kind == "progress" else 0)

  # -- the rollout split -------------------------------------------------------------------------

  def _observe_rate(self, name: str, windows: int) -> None:
    """Counts `windows` a worker decoded, over the time it held requests since last time."""
    now = time.perf_counter()
    since, held = self._worker_clock.get(name, (now, False))
    self.rates.observe(name, windows, now - since if held else 0.0)
    self._worker_clock[name] = (now, name in self.assigned.values())

  def _replan_split(self) -> None:
    """Re-plans each worker's share of the rollout work after the worker set changed."""
    self.split = self.rates.shares()
    self.counters["split_replans"] += 1
    log.info(
      "Rollout split over %d workers: %s",
      len(self.split),
      ", ".join(f"{n} {share:.0%}" for n, share in sorted(self.split.items())),
    )

  def _score(self, group: Group) -> None:
    completions = [record_completion(r) for r in group.records]
    scored = self.score([group.prompt] * len(completions), completions)
    group.rewards = scored.rewards_b
    self.counters["reward_timeouts"] += scored.timeouts
    self.ready.append(group.gid)

  def _check_workers(self) -> None:
    for name, worker in list(self.workers.items()):
      if not worker.alive:  # died without a word (the event of a crash is handled first)
        self._handle_events(block=False)
        self._drop_worker(name, "lost")

  # -- admission and dispatch --------------------------------------------------------------------

  def _release(self) -> None:
    """Starts the groups admission control allows: k < (version + eta + 1) x batch."""
    g = self.cfg.rollout.group_size
    cap = admission_cap(
      self.state.version, self.loop.max_staleness, self.cfg.rollout.prompts_per_step
    )
    released = []
    while self.next_group < cap:
      for prompt in next(self.loader):
        gid = self.next_group
        self.next_group += 1
        ids = self.encode_prompts([prompt])[0]
        records = [
          RequestRecord(
            request_id=request_id(gid, j),
            prompt_ids=ids,
            sampling=self.sampling,
            seed=_step_seed(self.cfg.seed, gid * g + j),
          )
          for j in range(g)
        ]
        self.groups[gid] = Group(gid, prompt, self.state.version, records, [False] * len(records))
        released += [r.request_id for r in records]
    if (
      self.loop.skew_aware_dispatch
    ):  # longest predicted first; stable, so release order breaks ties
      released.sort(key=lambda rid: -self._predicted_left(rid))
    self.pending.extend(released)

  def _predicted_left(self, rid: str) -> float:
    """Tokens the request is predicted still to generate (at least 1)."""
    gid, j = parse_request_id(rid)
    group = self.groups[gid]
    return max(1.0, self.lengths.predict(group.prompt["id"]) - len(group.records[j].token_ids))

  def _dispatch(self) -> None:
    """Hands queued requests to workers with room, each to the one that would finish its
    outstanding work first: predicted tokens (skew-aware) or requests, over its rate."""
    count = collections.Counter(self.assigned.values())
    load = collections.Counter()
    for rid, name in self.assigned.items():
      load[name] += self._predicted_left(rid) if self.loop.skew_aware_dispatch else 1
    live = [w for w in self.workers.values() if w.alive and w.name not in self.leaving]
    rate = {w.name: self.rates.rate(w.name) for w in live}
    batches = collections.defaultdict(list)
    while self.pending:
      open_ = [w for w in live if count[w.name] < w.capacity]
      if not open_:
        break
      worker = min(open_, key=lambda w: load[w.name] / rate[w.name])
      if not count[worker.name]:  # it starts holding requests now: so does its busy time
        self._worker_clock[worker.name] = (time.perf_counter(), True)
      rid = self.pending.popleft()
      gid, j = parse_request_id(rid)
      group = self.groups[gid]
      # A copy: the worker's engine appends to its record while the controller keeps its own.
      batches[worker.name].append(Assignment(copy_record(group.records[j]), group.version))
      self.assigned[rid] = worker.name
      count[worker.name] += 1
      load[worker.name] += self._predicted_left(rid) if self.loop.skew_aware_dispatch else 1
    for name, assignments in batches.items():
      self.workers[name].submit(assignments)

  # -- training ----------------------------------------------------------------------------------

  def _choose_batch(self) -> list[Group] | None:
    """The groups of the next step, or None while the learner must wait (`choose_batch`)."""
    ready = [(gid, self.groups[gid].version) for gid in self.ready]
    waiting = set(self.ready)
    in_flight = [g.version for gid, g in self.groups.items() if gid not in waiting]
    choice = choose_batch(
      ready,
      in_flight,
      self.state.version,
      self.loop.max_staleness,
      self.cfg.rollout.prompts_per_step,
    )
    if choice is None:
      return None
    if choice.forced:
      log.warning(
        "Step %d trains although a group left over cannot be trained within max_staleness=%d "
        "(nothing is in flight to wait for).", self.state.step, self.loop.max_staleness,
      )  # fmt: skip
    return [self.groups[gid] for gid in choice.groups]

  def _train(self, groups: list[Group]) -> dict[str, float]:
    v, eta = self.state.version, self.loop.max_staleness
    for g in groups:
      if v - g.oldest_version() > eta:
        raise RuntimeError(
          f"Group {g.gid} has a token of version {g.oldest_version()} at learner version {v}, "
          f"beyond max_staleness={eta}; admission control is broken."
        )
    completions = [record_completion(r) for g in groups for r in g.records]
    rewards_b = np.concatenate([g.rewards for g in groups])
    advantages_b = np.asarray(
      group_advantages(rewards_b, self.cfg.rollout.group_size, mode=self.cfg.train.advantage)
    )
    batch = build_batch(completions, advantages_b, self.tokenizer.pad_id)
    t = time.perf_counter()
    with self.timeline.span(LEARNER_LANE, "train"):
      train_metrics = jax.device_get(self.learner.update(batch))
    time_train = time.perf_counter() - t
    for hook in self.on_train:
      hook(self.state.step, groups)
    for g in groups:
      del self.groups[g.gid]
    chosen = {g.gid for g in groups}
    self.ready = [gid for gid in self.ready if gid not in chosen]

    t = time.perf_counter()
    self.state.version += 1
    self.state.step += 1
    self.publish()
    self._release()
    time_publish = time.perf_counter() - t

    lags = np.concatenate([v - c.versions for c in completions])
    sample_lag = np.array([v - int(c.versions.min()) for c in completions])
    metrics = {
      **batch_metrics(rewards_b, completions),
      "version": self.state.version,
      "off_policy_token_frac": float(np.mean(lags > 0)),
      "staleness_mean": float(sample_lag.mean()),
      **{f"staleness_{k}": float(np.mean(sample_lag == k)) for k in range(eta + 1)},
      "time_train": time_train,
      "time_weight_sync": time_publish,
      "workers": len(self.workers),
      **{k: float(v) for k, v in train_metrics.items()},
    }
    return metrics

  # -- weights -----------------------------------------------------------------------------------

  def publish(self) -> None:
    """Publishes a host copy of the learner's weights (the learner donates its own buffers) and
    tells the workers the oldest version they may still generate with. A learner in another
    process may publish from there in the background (the span here is then the hand-off, and
    its process records the publication); a worker that needs the version waits for it."""
    with self.timeline.span(LEARNER_LANE, "weight-sync"):
      self.learner.publish_to(self.weights, self.state.version)
    for worker in self.workers.values():
      worker.set_min_version(self.state.version - self.loop.max_staleness)

  def evaluate(self) -> dict[str, float]:
    if self._eval_version != self.state.version:
      self.rollout.update_weights(self.learner.params, self.state.version)
      self._eval_version = self.state.version
    return super().evaluate()

  # -- checkpoints -------------------------------------------------------------------------------

  def controller_state(self) -> dict:
    """The step and version, plus every released, untrained group with its tokens so far."""
    return super().controller_state() | {
      "next_group": self.next_group,
      "groups": [g.to_dict() for g in self.groups.values()],
      "ready": list(self.ready),
      "lengths": self.lengths.state(),
    }

  def load_controller_state(self, state: dict) -> None:
    self.next_group = state.pop("next_group", 0)
    groups = [Group.from_dict(d) for d in state.pop("groups", [])]
    ready = state.pop("ready", [])
    self.lengths.load(state.pop("lengths", {}))
    super().load_controller_state(state)
    self.groups = {g.gid: g for g in groups}
    self.assigned.clear()
    self.pending = collections.deque(
      request_id(g.gid, j) for g in groups for j, done in enumerate(g.done) if not done
    )
    self.ready = []
    for gid in ready:
      self._score(self.groups[gid])

  # -- the loop ----------------------------------------------------------------------------------

  def run(self, until: int | None = None) -> dict[str, float]:
    """Runs until step `until` (default `config.train.steps`); returns the first and last eval
    rewards of this call.

    Workers are stopped on return (and on an exception): their unfinished requests stay in
    the controller's state as the records they last streamed.
    """
    steps = self.cfg.train.steps if until is None else until
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
        "AsyncController.run has no rollout workers; add some with add_worker(make_worker(...))."
      )
    evals = {}
    if self.cfg.eval.every and self.state.step < steps:
      evals["eval_reward_start"] = self._eval_and_write()
    bar = self._progress_bar("GRPO async")
    try:
      wait_start = time.perf_counter()
      while self.state.step < steps:
        for hook in self.hooks:
          hook(self)
        self._handle_events(block=True)
        self._check_workers()
        self._dispatch()
        groups = self._choose_batch()
        if groups is None:
          continue
        time_wait = time.perf_counter() - wait_start
        metrics = self._train(groups)
        metrics["time_wait"] = time_wait
        metrics["time_step"] = time.perf_counter() - wait_start
        self._after_step(metrics, bar, evals)  # eval and checkpoint: not learner idle time
        wait_start = time.perf_counter()
    finally:
      bar.close()
      self.stop_workers()
    self.weights.wait_for(self.state.version)  # a later `run` finds the store up to date
    return evals

  def stop_workers(self) -> None:
    """Stops every worker; their requests go back to the queue as last streamed."""
    for worker in self.workers.values():
      worker.kill()
    for worker in self.workers.values():
      worker.join()
    self._handle_events(block=False)  # what they streamed before they stopped
    for name in list(self.workers):
      self._drop_worker(name, "stopped")
