"""The rollout side of the `ray` backend: a rollout instance as one Ray actor process, or as a
gang of `rollout.num_processes` processes with one engine mesh over all their devices.

The controller does not know which: `RayWorker` answers to the same calls as `LocalWorker`
(`workers.RolloutWorker`) and forwards the instance's events into the controller's queue.

One process (`RolloutActor`, rank 0 of 1): `LocalWorker`'s loop on a paged engine over the
process's devices, reading weights through `RemoteStore`, which turns any failure to reach
the store actor into `StoreUnreachable`.

A gang (ranks 0..P-1 of P): the P actors join a JAX world of their own (their own coordinator,
on rank 0's node; not the learner's world) and each builds the same engine over the mesh of
all their devices (`policy.rollout_worker_mesh`, as a one-process worker does). The engine's
calls are SPMD, so rank 0 decides and the others repeat (`spmd_engine`): rank 0 runs
`LocalWorker`'s loop on a `MirroredEngine`, which sends each engine call, in order, to the
other ranks' `Follower`s as a Ray call. Weights: rank 0 pulls a version from the store actor
and passes the other ranks the reference of what the store actor returned, so each rank reads
that same version from the object store itself (never from rank 0's memory) and places its own
shards on its devices. Host read-backs are replicated over the processes by the engine's
calls, so every rank's host side stays the same.

Losing a process: `RayWorker` polls rank 0 for events and asks the other ranks every
`check_s` whether they run. A process gone (Ray reports its actor dead), a rank failed, or a
rank in one engine call for more than `call_timeout_s` (a collective waiting for a process
that does not come), and the handle kills every process of the instance and stops: the
controller finds the worker gone and re-dispatches its requests from its own copies, as for a
one-process worker killed. No wait between processes is without a timeout: the JAX world's
join (`join_timeout_s`), the weights' fetch, and each engine call (`call_timeout_s`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from jaxrl.compile_cache import use_compile_cache
from jaxrl.config import ExperimentConfig
from jaxrl.rl.ray_learner import coordinator_address, join_jax_world, local_devices, pin_cores
from jaxrl.rl.spmd_engine import Follower, MirroredEngine
from jaxrl.rl.timeline import ForwardingTimeline, StageTimeline
from jaxrl.rl.weights import StoreUnreachable, from_wire
from jaxrl.rl.workers import Assignment, LocalWorker, WorkerEvent

log = logging.getLogger(__name__)


class RemoteStore:
  """The store as a worker actor reads it: unreachable on any Ray error or timeout. With
  `share`, it keeps the reference of the version it pulled last for the gang's other ranks
  (`take_ref`)."""

  def __init__(self, actor, timeout_s: float = 10.0, *, share: bool = False):
    self.actor = actor
    self.timeout_s = timeout_s
    self._share = share
    self._pulled: tuple[int, ray.ObjectRef] | None = None

  def pull(self, have: int):
    ref = self.actor.pull.remote(have)
    try:
      pulled = from_wire(ray.get(ref, timeout=self.timeout_s))
    except (ray.exceptions.RayError, TimeoutError) as e:
      raise StoreUnreachable(f"weight store actor: {type(e).__name__}: {e}") from e
    if pulled is not None and self._share:
      self._pulled = (pulled[0], ref)
    return pulled

  def take_ref(self, version: int) -> ray.ObjectRef:
    """The reference of version `version`, pulled last (dropped here: the ranks that read it
    hold it until they have)."""
    pulled, self._pulled = self._pulled, None
    if pulled is None or pulled[0] != version:
      raise RuntimeError(f"Weights version {version} were not the last pulled ({pulled}).")
    return pulled[1]


@ray.remote
class RolloutActor:
  """One process of a rollout instance: rank `rank` of `num_processes`, holding `num_devices`
  devices. Alone, it builds its engine when made; in a gang, in `build`, once the ranks have
  joined their JAX world."""

  def __init__(
    self,
    name: str,
    cfg: ExperimentConfig,
    store_actor,
    num_devices: int,
    mesh_axes: dict[str, int],
    cores: list | None,
    rank: int = 0,
    num_processes: int = 1,
    fetch_s: float = 300.0,
  ):
    """`fetch_s`: how long a follower rank waits for the weights rank 0 names."""
    pin_cores(cores)
    use_compile_cache(cfg.compile_cache_dir)
    self.name, self.cfg, self.store_actor = name, cfg, store_actor
    self.num_devices, self.mesh_axes = num_devices, mesh_axes
    self.rank, self.num_processes = rank, num_processes
    self.events: queue.Queue = queue.Queue()
    self.worker: LocalWorker | None = None  # rank 0's
    self.follower: Follower | None = None  # the other ranks'
    if rank > 0:  # takes rank 0's calls from the start; runs them once built
      fetch = lambda ref: from_wire(ray.get(ref, timeout=fetch_s))  # noqa: E731
      self.follower = Follower(fetch, f"{name}-{rank}")
    self.failed = ""  # why the build failed
    self._watch = None  # rank 0's `CallWatch`, in a gang
    self._built = threading.Event()
    self._lock = threading.Lock()
    self._early: list[Callable[[LocalWorker], None]] = []  # control calls made before the build
    if num_processes == 1:
      self._build(local_devices(num_devices, f"Rollout worker {name}"), [])

  def coordinator_address(self) -> str:
    return coordinator_address()

  def build(self, coordinator: str, join_timeout_s: int, followers: list):
    """Joins the gang's JAX world at `coordinator` and builds this rank's engine over every
    rank's devices; rank 0 sends its engine calls to `followers` (the other ranks' actors)."""
    try:
      devices = join_jax_world(
        coordinator, self.num_processes, self.rank, self.num_devices, join_timeout_s
      )
      total = self.num_devices * self.num_processes
      if len(devices) < total:
        raise ValueError(f"The rollout gang {self.name} has {len(devices)} devices, not {total}.")
      self._build(devices[:total], followers)
    except Exception as e:
      self.failed = f"rank {self.rank} failed to start: {type(e).__name__}: {e}"
      log.exception("Rollout gang %s: %s", self.name, self.failed)
      if self.rank == 0:  # the controller hears why its worker is gone
        self.events.put(WorkerEvent(self.name, "crashed", [], -1, self.failed))
      self._built.set()
      raise

  def _build(self, devices, followers: list) -> None:
    from jaxrl.model import Model
    from jaxrl.rl import policy

    cfg = self.cfg
    tokenizer = policy.make_tokenizer(cfg)
    model = Model(policy.rollout_model_config(cfg, policy.model_config(cfg, tokenizer)))
    mesh = policy.rollout_worker_mesh(devices, self.mesh_axes)
    engine = policy.make_rollout_engine(cfg, model, mesh, tokenizer)
    if self.follower is not None:
      self.follower.start(engine)
      self._built.set()
      return
    store = RemoteStore(self.store_actor, share=bool(followers))
    if followers:
      engine = MirroredEngine(engine, _Sender(followers), store.take_ref)
      self._watch = engine.watch
    worker = LocalWorker(
      self.name, engine, store, self.events, partial_rollouts=cfg.loop.partial_rollouts
    )
    # Its decode windows and compilations, sent to the controller's timeline with its events.
    worker.timeline = ForwardingTimeline()
    worker.timeline.bind_thread(worker.thread_name, worker.lane)
    with self._lock:  # the control calls made while the gang joined, in their order
      for call in self._early:
        call(worker)
      self.worker = worker
    worker.start()
    self._built.set()

  def _control(self, call: Callable[[LocalWorker], None]) -> None:
    with self._lock:
      if self.worker is None:
        self._early.append(call)
        return
    call(self.worker)

  def submit(self, assignments: list[Assignment]) -> None:
    self._control(lambda w: w.submit(assignments))

  def set_min_version(self, version: int) -> None:
    self._control(lambda w: w.set_min_version(version))

  def preempt(self) -> None:
    self._control(lambda w: w.preempt())

  def drop_kept(self, request_ids: list[str]) -> None:
    self._control(lambda w: w.drop_kept(request_ids))

  def release_memory(self) -> None:
    if self.worker is not None:  # one not built yet holds nothing
      self.worker.release_memory()

  def mesh_shape(self, timeout_s: float = 300.0) -> dict[str, int]:
    if not self._built.wait(timeout_s) or self.failed:
      raise RuntimeError(f"Rollout worker {self.name} is not built: {self.failed or 'timeout'}.")
    engine = self.worker.engine if self.worker else self.follower.engine
    return dict(engine.mesh.shape)

  def node_id(self) -> str:
    return ray.get_runtime_context().get_node_id()

  def apply(self, seq: int, commands: list) -> None:
    """Rank 0's engine calls number `seq` (a follower rank)."""
    self.follower.apply(seq, commands)

  def status(self, call_timeout_s: float) -> str:
    """ "" while this follower rank runs, else what stopped it."""
    if self.failed:
      return self.failed
    if not self.follower.started:
      return ""  # still joining or building
    if not self.follower.alive:
      return f"rank {self.rank} stopped: {self.follower.error}"
    stuck = self.follower.watch.stuck(call_timeout_s)
    return f"rank {self.rank} is {stuck}" if stuck else ""

  def drain(self, wait_s: float, call_timeout_s: float) -> tuple[list, list, str]:
    """Events so far (waiting up to `wait_s` for the first), timeline spans so far, and why
    the worker no longer runs ("" while it runs; "stopped" when its thread ended: it left, or
    crashed and said so in an event) (rank 0)."""
    out = []
    try:
      out.append(self.events.get(timeout=wait_s))
      while True:
        out.append(self.events.get_nowait())
    except queue.Empty:
      pass
    worker = self.worker
    if worker is None:  # a gang still joining: running unless its build failed
      return out, [], self.failed
    stopped = "" if worker.alive else "stopped"
    stuck = self._watch.stuck(call_timeout_s) if self._watch else ""
    if stuck:
      log.error("Rollout gang %s: rank 0 is %s.", self.name, stuck)
      stopped = f"rank 0 is {stuck}"
    return out, worker.timeline.drain(), stopped


class _Sender:
  """Rank 0's engine calls to the other ranks, numbered (a threaded actor may run two calls
  out of order; `Follower` puts them back in order)."""

  def __init__(self, followers: list):
    self.followers = followers
    self.seq = 0

  def __call__(self, commands: list) -> None:
    for follower in self.followers:
      follower.apply.remote(self.seq, commands)
    self.seq += 1


class RayWorker:
  """The controller's handle on a rollout instance of one or more `RolloutActor` processes,
  with `LocalWorker`'s interface."""

  def __init__(
    self,
    name: str,
    cfg: ExperimentConfig,
    store,
    events: queue.Queue | None = None,
    *,
    num_devices: int = 1,
    num_processes: int = 1,
    mesh_axes: dict[str, int] | None = None,
    cores: list[int] | None = None,
    actor_options: dict[str, Any] | None = None,
    poll_s: float = 0.05,
    check_s: float = 1.0,
    join_timeout_s: int = 300,
    call_timeout_s: float = 3600.0,
  ):
    """`store`: the store actor's handle (`ray_backend.RayWeightStore`). `num_devices`: the
    devices of each of its `num_processes` processes (a gang when > 1, one mesh over them
    all). `mesh_axes`: the rollout mesh's axes, which the worker's mesh keeps but for data
    (`policy.rollout_worker_mesh`; default: data alone). `actor_options` go to
    `RolloutActor.options` of each process (e.g. `resources`, `label_selector` or
    `accelerator_type` to place it on a node with the right accelerators); `cores` pins each
    process to these CPU cores. A gang's processes must join their JAX world within
    `join_timeout_s`, answer every `check_s`, and end each engine call within
    `call_timeout_s`; else the worker is lost."""
    self.name = name
    self.events = events
    self.timeline: StageTimeline | None = None  # set by the controller that runs the worker
    self.busy_s = 0.0  # seconds of its decode windows, from the spans it sends
    self.capacity = 2 * cfg.rollout.paged.max_running
    self.predicted_tokens_per_s = None  # its devices are the remote node's: unknown here
    self.poll_s, self.check_s, self.call_timeout_s = poll_s, check_s, call_timeout_s
    self.join_timeout_s = join_timeout_s
    options = {"max_concurrency": 4, "num_cpus": 0} | (actor_options or {})
    self._actors = [
      RolloutActor.options(**options).remote(
        name,
        cfg,
        store.actor,
        num_devices,
        mesh_axes or {},
        cores,
        rank,
        num_processes,
        float(join_timeout_s),
      )
      for rank in range(num_processes)
    ]
    self._actor = self._actors[0]
    if num_processes > 1:  # joins in the background; calls made meanwhile wait in the ranks
      coordinator = self._actor.coordinator_address.remote()
      for rank, actor in enumerate(self._actors):
        actor.build.remote(coordinator, join_timeout_s, self._actors[1:] if rank == 0 else [])
    self._pump = threading.Thread(target=self._forward, name=f"ray-{name}", daemon=True)
    self._killed = False

  def attach(self, events: queue.Queue, timeline: StageTimeline) -> None:
    """Where the events and spans its actor sends go (the actor binds its own thread)."""
    self.events, self.timeline = events, timeline

  def start(self) -> None:
    self._pump.start()

  def mesh_shape(self) -> dict[str, int]:
    """The axes of its engine's mesh, as the actor built it."""
    return ray.get(self._actor.mesh_shape.remote(), timeout=600)

  def node_id(self) -> str:
    """The Ray node its (first) process runs on."""
    return ray.get(self._actor.node_id.remote(), timeout=120)

  def _forward(self) -> None:
    """Moves rank 0's events into the controller's queue until the instance is gone."""
    next_check = time.monotonic() + self.check_s
    while not self._killed:
      try:
        # No timeout: an actor Ray has not placed yet (a node to come) is not lost.
        drained = self._actor.drain.remote(self.poll_s, self.call_timeout_s)
        events, spans, lost = ray.get(drained)
        if len(self._actors) > 1 and time.monotonic() > next_check:
          next_check = time.monotonic() + self.check_s
          lost = lost or self._followers_lost()
      except (ray.exceptions.RayError, TimeoutError) as e:
        if not self._killed:
          log.warning("Rollout actor %s is gone: %s", self.name, e)
        self._kill_actors()
        return
      for lane, start, end, kind in spans:
        self.busy_s += (end - start) if kind == "decode" else 0.0
        if self.timeline is not None:
          self.timeline.add(lane, start, end, kind)
      for event in events:
        if not self._killed:
          self.events.put(event)
      if lost:  # left on notice or crashed (its last event is forwarded above), or lost a rank
        crashed = [e.detail for e in events if e.kind == "crashed"]
        if (lost != "stopped" or crashed) and not self._killed:
          log.warning("Rollout worker %s stopped: %s", self.name, crashed[-1] if crashed else lost)
        self._kill_actors()
        return

  def _followers_lost(self) -> str:
    """Why a rank other than 0 cannot go on ("" while they all run); raises a Ray error if
    one's process is gone."""
    refs = [a.status.remote(self.call_timeout_s) for a in self._actors[1:]]
    return next((s for s in ray.get(refs, timeout=self.join_timeout_s) if s), "")

  def submit(self, assignments: list[Assignment]) -> None:
    self._actor.submit.remote(assignments)

  def set_min_version(self, version: int) -> None:
    self._actor.set_min_version.remote(version)

  def preempt(self) -> None:
    self._actor.preempt.remote()

  def drop_kept(self, request_ids: list[str]) -> None:
    self._actor.drop_kept.remote(request_ids)

  def release_memory(self, timeout_s: float = 60.0) -> None:
    try:
      ray.get(self._actor.release_memory.remote(), timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:  # a lost worker is found by the loop
      log.warning("Rollout actor %s did not free its memory: %s", self.name, e)

  def kill(self) -> None:
    """Kills its processes without notice."""
    self._killed = True
    self._kill_actors()

  def _kill_actors(self) -> None:
    for actor in self._actors:
      ray.kill(actor, no_restart=True)

  @property
  def alive(self) -> bool:
    return self._pump.is_alive()

  def join(self, timeout: float | None = None) -> None:
    self._pump.join(timeout)
