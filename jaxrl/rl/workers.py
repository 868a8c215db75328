"""Rollout workers of the asynchronous loop, and the `local` backend that runs them as threads.

A worker owns one paged engine on its own mesh. It takes requests as token-level records
(`RequestRecord`, new or partly generated), pulls the newest weights from the store when it is
between decode windows, decodes, and streams what it made back to the controller as events:
after every window the records of the requests that grew (`progress`), finished records
(`finished`), and on leaving the records it still held (`left`). The controller keeps the last
streamed copy of every request, so a worker that dies without notice loses at most the window
it was in.

Weight switches. With `partial_rollouts` a worker switches to new weights at the next window
boundary: its running requests are taken out and re-admitted, so their caches are rebuilt under
the new weights (prompt + generated prefix re-prefilled) and their later tokens carry the new
version. Without it, a worker finishes what it runs before it switches, and holds back requests
that need newer weights meanwhile. Either way it never decodes with weights older than
`min_version` (the learner's version minus the staleness bound): if it cannot get newer ones,
it reports `store_unreachable` and waits.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Protocol

from jaxrl.rl.timeline import StageTimeline
from jaxrl.rl.weights import StoreUnreachable, WeightStore
from jaxrl.rollout.paged import PagedEngine
from jaxrl.rollout.requests import RequestRecord

log = logging.getLogger(__name__)


class RolloutWorker(Protocol):
  """What the controller needs of a rollout worker, whatever runs it (a thread
  here, `LocalWorker`; Ray actors, `ray_rollout.RayWorker`). Control calls return at once."""

  name: str
  busy_s: float  # seconds of its decode windows so far
  predicted_tokens_per_s: float | None  # the scheduler's guess of its rate; None: unknown

  @property
  def capacity(self) -> int: ...

  @property
  def alive(self) -> bool: ...

  def attach(self, events: queue.Queue, timeline: StageTimeline) -> None:
    """Where its events and timeline spans go; called before `start`."""

  def start(self) -> None: ...

  def submit(self, assignments: list[Assignment]) -> None: ...

  def set_min_version(self, version: int) -> None: ...

  def preempt(self) -> None: ...

  def drop_kept(self, request_ids: list[str]) -> None:
    """Frees the KV pages its engine keeps for these requests' next turns (their multi-turn
    episodes ended: no next turn will come); pages already evicted or reused are no matter."""

  def release_memory(self, timeout_s: float = 60.0) -> None:
    """Drops its engine's weights and KV pages if it holds no request (the learner, on the
    same devices, is about to train), returning when done; the next weights it pulls bring
    them back."""

  def kill(self) -> None: ...

  def join(self, timeout: float | None = None) -> None: ...


@dataclasses.dataclass
class WorkerEvent:
  """What a worker tells the controller.

  Attributes:
    worker: the worker's name.
    kind: "progress" (records that grew), "finished", "left" (records handed back on a
      preemption notice), "crashed" (the worker died of an error; `detail` says which) or
      "store_unreachable".
    records: copies of the records concerned; the controller may keep them.
    version: the weight version the worker holds.
    detail: a message for "crashed" and "store_unreachable".
  """

  worker: str
  kind: str
  records: list[RequestRecord]
  version: int
  detail: str = ""


@dataclasses.dataclass(frozen=True)
class Assignment:
  """A request for a worker and the oldest weight version allowed to decode it (its group's
  version: tokens of a sample are never older than the version the sample was admitted at)."""

  record: RequestRecord
  min_version: int


def copy_record(record: RequestRecord) -> RequestRecord:
  """A copy that later decoding of `record` does not change (the engine appends in place)."""
  return dataclasses.replace(
    record,
    token_ids=list(record.token_ids),
    logprobs=list(record.logprobs),
    versions=list(record.versions),
    routing=list(record.routing),
    prompt_routing=list(record.prompt_routing),
  )


class LocalWorker:
  """A rollout worker running in a thread of this process (the `local` backend).

  Control calls (`submit`, `set_min_version`, `preempt`, `kill`) are thread-safe and return at
  once; the worker acts on them between decode windows.
  """

  def __init__(
    self,
    name: str,
    engine: PagedEngine,
    store: WeightStore,
    events: queue.Queue,
    *,
    partial_rollouts: bool,
    idle_wait_s: float = 0.01,
    predicted_tokens_per_s: float | None = None,
  ):
    self.name = name
    self.engine = engine
    self.store = store
    self.events = events
    self.partial_rollouts = partial_rollouts
    self.idle_wait_s = idle_wait_s
    # The scheduler's prediction of this worker's decode rate (None: unknown); the controller
    # splits the rollout work by it until it has measured the worker.
    self.predicted_tokens_per_s = predicted_tokens_per_s
    self._inbox: queue.Queue = queue.Queue()
    self._killed = threading.Event()
    self._min_version = -1
    self._held: list[Assignment] = []  # need newer weights than the engine has
    self._streamed: dict[str, int] = {}  # request id -> tokens already streamed
    self._unreachable_reported = False
    self.busy_s = 0.0  # seconds spent in decode windows (prefill included), for idle metrics
    self.timeline: StageTimeline | None = None  # set by the controller that runs the worker
    self._thread = threading.Thread(target=self._run, name=f"rollout-{name}", daemon=True)

  # -- control (any thread) ----------------------------------------------------------------------

  def attach(self, events: queue.Queue, timeline: StageTimeline) -> None:
    """Its events go to `events`; its decode windows and its thread's compilations to
    `timeline`."""
    self.events, self.timeline = events, timeline
    timeline.bind_thread(self.thread_name, self.lane)

  def start(self) -> None:
    self._thread.start()

  def submit(self, assignments: list[Assignment]) -> None:
    self._inbox.put(("submit", assignments))

  def set_min_version(self, version: int) -> None:
    self._inbox.put(("min_version", version))

  def preempt(self) -> None:
    """A preemption notice: hand back every request (as records) and leave."""
    self._inbox.put(("preempt", None))

  def drop_kept(self, request_ids: list[str]) -> None:
    self._inbox.put(("drop_kept", list(request_ids)))

  def release_memory(self, timeout_s: float = 60.0) -> None:
    """Returns once the worker's thread has dropped its engine's memory (or, holding requests,
    kept it), so that the learner's step that follows finds the memory free."""
    done = threading.Event()
    self._inbox.put(("release", done))
    if self.alive and not done.wait(timeout_s):
      log.warning("Rollout worker %s did not free its memory within %.0f s.", self.name, timeout_s)

  def kill(self) -> None:
    """Dies without notice: stops at once and says nothing more (a crashed machine). A
    precompilation its engine is running (`PagedConfig.precompile`, at its first weights)
    ends after the program under way."""
    self._killed.set()
    self.engine.stop_precompiling()
    self._inbox.put(("wake", None))

  @property
  def capacity(self) -> int:
    """Requests worth handing this worker at once: a running batch and as many queued."""
    return 2 * self.engine.cfg.max_running

  @property
  def lane(self) -> str:
    """Its lane in the stage timeline."""
    return f"worker {self.name}"

  @property
  def thread_name(self) -> str:
    return self._thread.name

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)

  # -- the thread --------------------------------------------------------------------------------

  def _emit(self, kind: str, records: list[RequestRecord], detail: str = "") -> None:
    if not self._killed.is_set():
      self.events.put(WorkerEvent(self.name, kind, records, self.engine.version, detail))

  def _run(self) -> None:
    try:
      while not self._killed.is_set():
        if not self._handle_inbox(block=not self._can_decode()):
          return  # left on a preemption notice
        if self._killed.is_set():
          return
        self._pull_weights()  # the engine's first weights may precompile it
        if self._killed.is_set():
          return
        self._release_held()
        if self._can_decode():
          start = time.time()
          finished = self.engine.step()
          end = time.time()
          self.busy_s += end - start
          self._record(start, end, "decode")
          if self._killed.is_set():
            return  # died mid-window: nothing of it reaches the controller
          self._stream(finished)
    except Exception as e:  # a crash is reported; the controller re-dispatches the requests
      log.exception("Rollout worker %s crashed.", self.name)
      self._emit("crashed", [], detail=repr(e))
    finally:  # a worker that stopped for any reason compiles nothing more for its engine
      self.engine.stop_precompiling()

  def _can_decode(self) -> bool:
    e = self.engine
    return e.params is not None and e.has_work and e.version >= self._min_version

  def _handle_inbox(self, block: bool) -> bool:
    """Applies queued control calls; False once the worker has left."""
    try:
      item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
    except queue.Empty:
      return True
    while True:
      kind, arg = item
      if kind == "submit":
        self._held.extend(arg)
      elif kind == "min_version":
        self._min_version = max(self._min_version, arg)
        self._unreachable_reported = False
      elif kind == "preempt":
        self._leave()
        return False
      elif kind == "drop_kept" and self.engine.params is not None:  # released: nothing kept
        for rid in arg:
          self.engine.drop_kept(rid)
      elif kind == "release":
        if not self.engine.has_work and not self._held:
          self.engine.release_memory()
        arg.set()
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return True

  def _leave(self) -> None:
    e = self.engine
    self._stream(e.drain())  # what finished in the window in flight is finished, not left
    ids = [*e.running, *(r.request_id for r in e.waiting)]
    records = [copy_record(r) for r in e.abort(ids)]
    records += [copy_record(a.record) for a in self._held]
    self._held.clear()
    self._emit("left", records)

  def _pull_weights(self) -> None:
    e = self.engine
    switch_now = self.partial_rollouts or not e.running or e.version < self._min_version
    if not switch_now:
      return
    try:
      # After `release_memory` the engine has no weights: it takes the next version, or the
      # one it had if it was given work without a newer one.
      needs_any = e.params is None and (e.has_work or self._held)
      pulled = self.store.pull(-1 if needs_any else e.version)
    except StoreUnreachable as err:
      if not self._unreachable_reported and (needs_any or e.version < self._version_needed()):
        self._emit("store_unreachable", [], detail=str(err))
        self._unreachable_reported = True
      return
    if pulled is None:
      return
    start = time.time()
    version, params = pulled
    self._stream(e.drain())
    running = e.abort(list(e.running))  # re-admitted below: caches rebuilt under new weights
    e.update_weights(params, version)
    # Taken out by a call, not by editing the queue: a gang repeats the calls (`spmd_engine`).
    waiting = e.abort([r.request_id for r in e.waiting])
    for record in [*running, *waiting]:
      e.submit(record)
    self._record(start, time.time(), "weight-sync")

  def _version_needed(self) -> int:
    """The oldest weights it can decode with: the loop's floor (`set_min_version`), and while
    the engine has no work, what the oldest of the requests it holds allows (a request admitted
    at a newer version than the engine's waits for that version: without it the worker holds
    work it can never start)."""
    needed = self._min_version
    if self._held and not self.engine.has_work:
      needed = max(needed, min(a.min_version for a in self._held))
    return needed

  def _record(self, start: float, end: float, kind: str) -> None:
    if self.timeline is not None:
      self.timeline.add(self.lane, start, end, kind)

  def _release_held(self) -> None:
    """Moves held requests into the engine once its weights are new enough for them."""
    e = self.engine
    if e.params is None:
      return
    keep = []
    for a in self._held:
      if a.min_version <= e.version:
        e.submit(a.record)
      else:
        keep.append(a)
    self._held = keep

  def _stream(self, finished: list[RequestRecord]) -> None:
    grown = []
    for state in self.engine.running.values():
      r = state.record
      if len(r.token_ids) > self._streamed.get(r.request_id, 0):
        self._streamed[r.request_id] = len(r.token_ids)
        grown.append(copy_record(r))
    if grown:
      self._emit("progress", grown)
    if finished:
      for r in finished:
        self._streamed.pop(r.request_id, None)
      self._emit("finished", [copy_record(r) for r in finished])
