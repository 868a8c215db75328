"""The rollout side of the RL loop: the workers, their events, and which request runs where.

`WorkerPool` is the controller's base class (`controller.py`): it starts, stops and loses
workers, turns their events into the controller's records, and hands queued requests to the
worker that would finish its outstanding work first, by each worker's share of the rollout
work (`dispatch.WorkerRates`). What a request *is* stays with the controller, which provides
`_assignment` (a request as sent), `_take_record` (a record streamed back), `_tokens_so_far`
and `_predicted_left`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import time

from jaxrl.rl.backends import Backend, VersionedStore
from jaxrl.rl.dispatch import WorkerRates
from jaxrl.rl.timeline import StageTimeline
from jaxrl.rl.workers import Assignment, RolloutWorker, WorkerEvent
from jaxrl.rollout.requests import RequestRecord

log = logging.getLogger(__name__)


class RolloutWorkersLost(RuntimeError):
  """The loop had no rollout worker for `config.loop.no_worker_timeout_s` and none came back."""


class WorkerPool:
  """The rollout workers of one controller and the requests they hold."""

  POLL_S = 0.05  # how long the loop waits for a worker event before checking on its workers
  JOIN_WARN_S = 30.0  # a stopping worker still running after this long is logged, and again

  def __init__(
    self,
    backend: Backend,
    weights: VersionedStore,
    timeline: StageTimeline,
    *,
    max_staleness: int,
    skew_aware_dispatch: bool,
    measured_rates: bool,
    worker_restarts: int = 0,
    no_worker_timeout_s: float = 60.0,
  ):
    """`worker_restarts`, `no_worker_timeout_s`: `config.loop`'s (a crashed worker's
    replacements in a run; how long the loop goes on with no worker before it stops)."""
    self.backend = backend
    self.weights = weights
    self.timeline = timeline
    self.max_staleness = max_staleness
    self.skew_aware_dispatch = skew_aware_dispatch
    self.events: queue.Queue[WorkerEvent] = queue.Queue()
    self.workers: dict[str, RolloutWorker] = {}
    self.leaving: set[str] = set()  # given notice, not gone yet: nothing new is sent to them
    self.pending: collections.deque[str] = collections.deque()  # request ids to dispatch
    self.assigned: dict[str, str] = {}  # request id -> worker
    # request id -> the worker whose engine may keep its pages for a next turn (`keep_kv`)
    self.kept_on: dict[str, str] = {}
    self.counters = collections.Counter()
    self.rollout_busy_s = 0.0  # decode time of the workers that have left
    self.rates = WorkerRates(min_work=8, measured=measured_rates)
    self.split: dict[str, float] = {}  # worker -> share of the rollout work (`_replan_split`)
    # worker -> (time of its last event or first assignment, whether it held requests then)
    self._worker_clock: dict[str, tuple[float, bool]] = {}
    self.min_version = -max_staleness  # the oldest weights a worker may still decode with
    self.slot_of: dict[str, object] = {}  # worker -> the devices or planned slot it runs on
    self._names = itertools.count(len(backend.worker_slots()))  # for workers added later
    self.restarts_left = worker_restarts
    self.no_worker_timeout_s = no_worker_timeout_s
    self._workers_gone_at: float | None = None  # when the last worker went (None: one runs)
    self._last_failure = ""  # the last crash or loss, for the error once none is left
    self._stopping = False  # in `stop_workers`: a crash reported now is not restarted
    # The workers the next `run` starts with (each call of `run` stops its workers on return;
    # the next one makes a fresh set).
    self.initial_workers: list[RolloutWorker] = self.fresh_workers()

  # -- what the controller provides --------------------------------------------------------------

  def _assignment(self, rid: str) -> Assignment:
    raise NotImplementedError

  def _take_record(self, rid: str, record: RequestRecord, finished: bool) -> None:
    raise NotImplementedError

  def _tokens_so_far(self, rid: str) -> int:
    raise NotImplementedError

  def _predicted_left(self, rid: str) -> float:
    raise NotImplementedError

  # -- workers -----------------------------------------------------------------------------------

  def make_worker(self, name: str, devices=None) -> RolloutWorker:
    """A new worker from the backend, pulling from this controller's store (`devices`: where
    a local worker runs, or a Ray worker's planned slot; None: where Ray finds room)."""
    self.slot_of[name] = devices
    return self.backend.make_worker(name, devices, self.weights)

  def fresh_workers(self) -> list[RolloutWorker]:
    """One new worker per slot of the backend (`stages.worker_count`)."""
    return [self.make_worker(f"w{i}", d) for i, d in enumerate(self.backend.worker_slots())]

  def follow_cluster(self) -> None:
    """When the backend re-planned the rollout for a changed cluster (`replan_rollout`), the
    workers follow the plan: one whose slot is no longer planned leaves with notice (its
    requests go on elsewhere), and each planned slot no worker holds gets a new one."""
    slots = self.backend.replan_rollout()
    if slots is None:
      return
    self.counters["cluster_replans"] += 1
    wanted = collections.Counter(repr(s) for s in slots)
    for name in list(self.workers):
      key = repr(self.slot_of.get(name))
      if wanted[key] > 0:
        wanted[key] -= 1
      elif name not in self.leaving:
        self.remove_worker(name)
    for slot in slots:
      if wanted[repr(slot)] > 0:
        wanted[repr(slot)] -= 1
        self.add_worker(self.make_worker(self._fresh_name(), slot))

  def _fresh_name(self) -> str:
    """`w<n>` for the next n no running worker holds: a caller may have added workers under
    such names itself (`add_worker(make_worker("w1"))`), and a name in use is refused."""
    while (name := f"w{next(self._names)}") in self.workers:
      pass
    return name

  def add_worker(self, worker: RolloutWorker) -> None:
    """Registers and starts a worker; it provisions itself by pulling the newest weights."""
    if worker.name in self.workers:
      raise ValueError(f"A worker named {worker.name!r} is already running.")
    worker.attach(self.events, self.timeline)
    self.workers[worker.name] = worker
    worker.set_min_version(self.min_version)
    worker.start()
    self.counters["workers_added"] += 1
    self.rates.add(worker.name, worker.predicted_tokens_per_s)
    self._replan_split()

  def set_min_version(self, version: int) -> None:
    """Tells every worker (and any added later) the oldest weights it may decode with."""
    self.min_version = version
    for worker in self.workers.values():
      worker.set_min_version(version)

  def remove_worker(self, name: str) -> None:
    """A preemption notice: the worker hands back its requests and leaves (asynchronously)."""
    self.leaving.add(name)
    self.workers[name].preempt()

  def kill_worker(self, name: str) -> None:
    """Kills a worker without notice; its requests continue elsewhere from their last
    streamed tokens."""
    worker = self.workers[name]
    worker.kill()
    self._join(name, worker)
    self._handle_events(block=False)
    self._drop_worker(name, "killed")

  def _join(self, name: str, worker: RolloutWorker) -> None:
    """Waits for a killed worker to stop, saying so every `JOIN_WARN_S`: a worker stops
    between engine steps, and one step (a compilation, a long window) can take minutes; it is
    not abandoned while it may still hold its devices."""
    start = time.monotonic()
    worker.join(self.JOIN_WARN_S)
    while worker.alive:
      log.warning(
        "Rollout worker %s was told to stop %.0f s ago and is still in an engine step; "
        "waiting for it to finish.",
        name,
        time.monotonic() - start,
      )
      worker.join(self.JOIN_WARN_S)

  def _drop_worker(self, name: str, why: str, detail: str = "") -> None:
    self.leaving.discard(name)
    slot = self.slot_of.pop(name, None)
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
    self.counters["tokens_kept_on_redispatch"] += sum(map(self._tokens_so_far, lost))
    log.info("Rollout worker %s %s; %d requests go back to the queue.", name, why, len(lost))
    if why in ("crashed", "lost"):
      self._last_failure = f"{name} {why}" + (f": {detail}" if detail else "")
    if why == "crashed" and self.restarts_left > 0 and not self._stopping:
      # An error in the worker, not a lost machine: its devices are still there.
      self.restarts_left -= 1
      self.counters["workers_restarted"] += 1
      new = self._fresh_name()
      log.warning("Restarting crashed rollout worker %s as %s on its devices.", name, new)
      self.add_worker(self.make_worker(new, slot))

  def check_workers_left(self) -> None:
    """Raises `RolloutWorkersLost` once no worker has run for `no_worker_timeout_s` (nothing
    would ever decode the queued requests: the loop would wait forever)."""
    if self.workers:
      self._workers_gone_at = None
      return
    now = time.monotonic()
    if self._workers_gone_at is None:
      self._workers_gone_at = now
      log.warning(
        "No rollout worker is left (last: %s); waiting up to %.0f s for one to be added.",
        self._last_failure or "withdrawn",
        self.no_worker_timeout_s,
      )
    if now - self._workers_gone_at >= self.no_worker_timeout_s:
      raise RolloutWorkersLost(
        f"No rollout worker ran for {self.no_worker_timeout_s:.0f} s "
        f"(config.loop.no_worker_timeout_s), so no request could be decoded; the last one "
        f"went: {self._last_failure or 'withdrawn (its weight store was unreachable)'}. "
        f"Crashed workers were restarted {self.counters['workers_restarted']} times "
        f"(config.loop.worker_restarts). Fix the cause (the workers' errors are logged above) "
        f"and resume with --config.resume=True."
      )

  def stop_workers(self) -> None:
    """Stops every worker; their requests go back to the queue as last streamed."""
    self._stopping = True
    try:
      for worker in self.workers.values():
        worker.kill()
      for name, worker in self.workers.items():
        self._join(name, worker)
      self._handle_events(block=False)  # what they streamed before they stopped
      for name in list(self.workers):
        self._drop_worker(name, "stopped")
    finally:
      self._stopping = False

  def _check_workers(self) -> None:
    for name, worker in list(self.workers.items()):
      if not worker.alive:  # died without a word (the event of a crash is handled first)
        self._handle_events(block=False)
        self._drop_worker(name, "lost")

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
      self._drop_worker(ev.worker, "crashed", ev.detail)
      return
    if ev.kind == "store_unreachable":
      # Its weights are too old to generate with and it cannot get newer ones: withdraw it so
      # its requests continue elsewhere. It may be added again once the store is reachable.
      if ev.worker in self.leaving:
        return  # said again before it read its notice (a newer floor reached it meanwhile)
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
      if ev.kind in ("finished", "left"):
        del self.assigned[rid]
      if ev.kind == "finished" and record.keep_kv:
        self.kept_on[rid] = ev.worker
      if ev.kind == "left":
        self.pending.appendleft(rid)
        self.counters["requests_handed_back"] += 1
        self.counters["tokens_kept_on_redispatch"] += len(record.token_ids)
      self._take_record(rid, record, finished=ev.kind == "finished")
    if ev.kind == "left":
      self._drop_worker(ev.worker, "preempted")
      return
    # A worker streams one "progress" event per decode window: its rate of windows, unlike its
    # rate of tokens, does not grow with the work it is given (which would draw ever more work
    # to whichever worker happened to get more).
    self._observe_rate(ev.worker, 1 if ev.kind == "progress" else 0)

  def _drop_kept(self, rid: str) -> None:
    """The request will have no next turn: the worker that kept its pages frees them (they
    would be evicted under pressure anyway, but would crowd out newer turns' until then)."""
    name = self.kept_on.pop(rid, None)
    if name in self.workers:
      self.workers[name].drop_kept([rid])

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

  def _dispatch(self) -> None:
    """Hands queued requests to workers with room, each to the one that would finish its
    outstanding work first: predicted tokens (skew-aware) or requests, over its rate."""
    count = collections.Counter(self.assigned.values())
    load = collections.Counter()
    for rid, name in self.assigned.items():
      load[name] += self._predicted_left(rid) if self.skew_aware_dispatch else 1
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
      batches[worker.name].append(self._assignment(rid))
      self.assigned[rid] = worker.name
      count[worker.name] += 1
      load[worker.name] += self._predicted_left(rid) if self.skew_aware_dispatch else 1
    for name, assignments in batches.items():
      self.workers[name].submit(assignments)
