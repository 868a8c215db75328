"""The `ray` backend of the asynchronous loop: each rollout worker and the learner is a Ray
actor (its own process, its own JAX runtime and devices), and the weight store is an actor all
of them reach.

The controller does not know which backend runs: `RayWorker` answers to the same calls as
`LocalWorker` (`start`, `submit`, `set_min_version`, `preempt`, `kill`, `alive`, `join`,
`capacity`) and forwards the actor's events into the controller's queue. Inside the actor the
loop is `LocalWorker`'s, reading weights through `RemoteStore`, which turns any failure to reach
the store actor into `StoreUnreachable`. The learner is one actor or a gang of them
(`ray_learner`, `train.num_processes`), publishing its shards to the store actor directly. Ray
is the optional extra `ray`.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

import ray

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.rl.ray_cluster import ProcessSlot, RayPlacement, replan_placement
from jaxrl.rl.ray_learner import RayLearner, local_devices, pin_cores
from jaxrl.rl.stages import JobParts, rollout_device_groups
from jaxrl.rl.timeline import ForwardingTimeline, StageTimeline
from jaxrl.rl.weights import StoreUnreachable, WeightStore
from jaxrl.rl.workers import Assignment, LocalWorker

log = logging.getLogger(__name__)


@ray.remote
class WeightStoreActor:
  """The versioned store as a Ray actor (host arrays; readers re-shard onto their meshes)."""

  def __init__(self):
    self._store = WeightStore()

  def publish(self, params, version: int) -> None:
    self._store.publish(params, version)

  def publish_part(self, version: int, part: int, num_parts: int, shards) -> None:
    self._store.publish_part(version, part, num_parts, shards)

  def pull(self, have: int):
    return self._store.pull(have)

  def version(self) -> int:
    return self._store.version


class RayWeightStore:
  """The controller's handle on the store actor, with `WeightStore`'s calls."""

  def __init__(self, actor=None, timeout_s: float = 60.0):
    self.actor = actor or WeightStoreActor.remote()
    self.timeout_s = timeout_s

  def publish(self, params, version: int) -> None:
    # Waits until the store holds it: a version is released to workers only once pullable.
    ray.get(self.actor.publish.remote(params, version), timeout=self.timeout_s)

  def pull(self, have: int):
    return ray.get(self.actor.pull.remote(have), timeout=self.timeout_s)

  @property
  def version(self) -> int:
    return ray.get(self.actor.version.remote(), timeout=self.timeout_s)

  def wait_for(self, version: int) -> None:
    """Waits until the store holds `version` or newer (a learner actor publishes in the
    background); raises TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + self.timeout_s
    while self.version < version:
      if time.monotonic() > deadline:
        raise TimeoutError(
          f"The weight store actor still holds version {self.version} {self.timeout_s:.0f} s "
          f"after version {version} was published; the learner actor's publication failed or "
          "hangs (its error, if any, comes with the learner's next call)."
        )
      time.sleep(0.01)


class RemoteStore:
  """The store as a worker actor reads it: unreachable on any Ray error or timeout."""

  def __init__(self, actor, timeout_s: float = 10.0):
    self.actor = actor
    self.timeout_s = timeout_s

  def pull(self, have: int):
    try:
      return ray.get(self.actor.pull.remote(have), timeout=self.timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:
      raise StoreUnreachable(f"weight store actor: {type(e).__name__}: {e}") from e


@ray.remote
class RolloutActor:
  """A rollout worker process: a paged engine on this process's devices, run by `LocalWorker`."""

  def __init__(
    self,
    name: str,
    cfg: ExperimentConfig,
    store_actor,
    num_devices: int,
    mesh_axes: dict[str, int],
    cores: list | None,
  ):
    pin_cores(cores)
    from jaxrl.model import Model
    from jaxrl.rl import policy

    tokenizer = policy.make_tokenizer(cfg)
    devices = local_devices(num_devices, f"Rollout worker {name}")
    model = Model(policy.rollout_model_config(cfg, policy.model_config(cfg, tokenizer)))
    mesh = policy.rollout_worker_mesh(devices, mesh_axes)
    engine = policy.make_rollout_engine(cfg, model, mesh, tokenizer)
    self.events: queue.Queue = queue.Queue()
    self.worker = LocalWorker(
      name,
      engine,
      RemoteStore(store_actor),
      self.events,
      partial_rollouts=cfg.loop.partial_rollouts,
    )
    # Its decode windows and compilations, sent to the controller's timeline with its events.
    self.worker.timeline = ForwardingTimeline()
    self.worker.timeline.bind_thread(self.worker.thread_name, self.worker.lane)
    self.worker.start()

  def submit(self, assignments: list[Assignment]) -> None:
    self.worker.submit(assignments)

  def mesh_shape(self) -> dict[str, int]:
    return dict(self.worker.engine.mesh.shape)

  def node_id(self) -> str:
    return ray.get_runtime_context().get_node_id()

  def set_min_version(self, version: int) -> None:
    self.worker.set_min_version(version)

  def preempt(self) -> None:
    self.worker.preempt()

  def release_memory(self) -> None:
    self.worker.release_memory()

  def drain(self, wait_s: float) -> tuple[list, list, bool]:
    """Events so far (waiting up to `wait_s` for the first), timeline spans so far, and
    whether the worker runs."""
    out = []
    try:
      out.append(self.events.get(timeout=wait_s))
      while True:
        out.append(self.events.get_nowait())
    except queue.Empty:
      pass
    return out, self.worker.timeline.drain(), self.worker.alive


class RayWorker:
  """The controller's handle on a `RolloutActor`, with `LocalWorker`'s interface."""

  def __init__(
    self,
    name: str,
    cfg: ExperimentConfig,
    store: RayWeightStore,
    events: queue.Queue | None = None,
    *,
    num_devices: int = 1,
    mesh_axes: dict[str, int] | None = None,
    cores: list[int] | None = None,
    actor_options: dict[str, Any] | None = None,
    poll_s: float = 0.05,
  ):
    """`mesh_axes`: the rollout mesh's axes, which the worker's mesh keeps but for data
    (`policy.rollout_worker_mesh`; default: data alone). `actor_options` go to
    `RolloutActor.options` (e.g. `resources`, `label_selector` or `accelerator_type` to place
    the worker on a node with the right accelerators); `cores` pins the actor's process to
    these CPU cores."""
    self.name = name
    self.events = events
    self.timeline: StageTimeline | None = None  # set by the controller that runs the worker
    self.busy_s = 0.0  # seconds of its decode windows, from the spans it sends
    self.capacity = 2 * cfg.rollout.paged.max_running
    self.predicted_tokens_per_s = None  # its devices are the remote node's: unknown here
    self.poll_s = poll_s
    options = {"max_concurrency": 4, "num_cpus": 0} | (actor_options or {})
    self._actor = RolloutActor.options(**options).remote(
      name, cfg, store.actor, num_devices, mesh_axes or {}, cores
    )
    self._pump = threading.Thread(target=self._forward, name=f"ray-{name}", daemon=True)
    self._killed = False

  def attach(self, events: queue.Queue, timeline: StageTimeline) -> None:
    """Where the events and spans its actor sends go (the actor binds its own thread)."""
    self.events, self.timeline = events, timeline

  def start(self) -> None:
    self._pump.start()

  def mesh_shape(self) -> dict[str, int]:
    """The axes of its engine's mesh, as the actor built it."""
    return ray.get(self._actor.mesh_shape.remote(), timeout=120)

  def node_id(self) -> str:
    """The Ray node its actor runs on."""
    return ray.get(self._actor.node_id.remote(), timeout=120)

  def _forward(self) -> None:
    """Moves the actor's events into the controller's queue until the actor is gone."""
    while not self._killed:
      try:
        events, spans, running = ray.get(self._actor.drain.remote(self.poll_s))
      except ray.exceptions.RayError as e:
        if not self._killed:
          log.warning("Rollout actor %s is gone: %s", self.name, e)
        return
      for lane, start, end, kind in spans:
        self.busy_s += (end - start) if kind == "decode" else 0.0
        if self.timeline is not None:
          self.timeline.add(lane, start, end, kind)
      for event in events:
        if not self._killed:
          self.events.put(event)
      if not running:  # left on notice or crashed: its last event is forwarded above
        ray.kill(self._actor, no_restart=True)
        return

  def submit(self, assignments: list[Assignment]) -> None:
    self._actor.submit.remote(assignments)

  def set_min_version(self, version: int) -> None:
    self._actor.set_min_version.remote(version)

  def preempt(self) -> None:
    self._actor.preempt.remote()

  def release_memory(self, timeout_s: float = 60.0) -> None:
    try:
      ray.get(self._actor.release_memory.remote(), timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:  # a lost worker is found by the loop
      log.warning("Rollout actor %s did not free its memory: %s", self.name, e)

  def kill(self) -> None:
    """Kills the actor process without notice."""
    self._killed = True
    ray.kill(self._actor, no_restart=True)

  @property
  def alive(self) -> bool:
    return self._pump.is_alive()

  def join(self, timeout: float | None = None) -> None:
    self._pump.join(timeout)


class RayBackend:
  """The `ray` backend (`backends.Backend`): the learner, the store and each rollout worker as
  Ray actors. With `loop.ray_pin_cores` the learner's actor and the workers' get disjoint
  halves of this machine's cores (one-machine runs). With a `placement` (a plan for the Ray
  cluster, `ray_cluster.plan_placement`) the learner's processes and one worker per planned
  rollout instance go to the nodes of the pools the plan chose, with its meshes."""

  CLUSTER_CHECK_S = 2.0  # how often `replan_rollout` reads the Ray cluster's nodes

  def __init__(self, parts: JobParts, placement: RayPlacement | None = None):
    self.parts = parts
    self.placement = placement
    self._next_check = 0.0
    pin = parts.cfg.loop.ray_pin_cores
    self._learner_cores, self._worker_cores = core_split() if pin else (None, None)
    self._made = itertools.count()
    self._device_groups = rollout_device_groups(parts)
    self._devices_per_worker = len(self._device_groups[0])

  def make_learner(self, model) -> RayLearner:
    del model  # the actor builds its own from the config
    cfg = self.parts.cfg
    if self.placement is not None:
      slots = self.placement.learner
      return RayLearner(
        cfg,
        self.placement.train_mesh,
        num_processes=len(slots),
        rank_options=[s.actor_options for s in slots],
      )
    shape = dict(self.parts.placement.train_mesh.shape)
    return RayLearner(cfg, shape, num_processes=cfg.train.num_processes, cores=self._learner_cores)

  def make_store(self) -> RayWeightStore:
    return RayWeightStore()

  def attach_learner(self, learner: RayLearner, timeline: StageTimeline) -> None:
    learner.timeline = timeline  # the actor's spans come back with its results

  def supervised_trainer(self, learner: RayLearner, learning_rate: float):
    return learner.supervised_trainer(learning_rate)  # in the learner's actor

  def worker_slots(self) -> list[ProcessSlot | None]:
    """The plan's rollout instances, or one slot per worker (`stages.worker_count`) that Ray
    places."""
    if self.placement is not None:
      return list(self.placement.rollout)
    return [None] * len(self._device_groups)

  def replan_rollout(self) -> list[ProcessSlot] | None:
    """With a plan for the Ray cluster: when its alive nodes differ from what the plan was made
    for, the re-planned rollout slots (`ray_cluster.replan_placement`), checked at most every
    `CLUSTER_CHECK_S`; None otherwise."""
    now = time.monotonic()
    if self.placement is None or now < self._next_check:
      return None
    self._next_check = now + self.CLUSTER_CHECK_S
    replanned = replan_placement(self.parts.cfg, self.parts.prompt_len, self.placement, ray.nodes())
    if replanned is None:
      return None
    self.placement = replanned[0]
    return list(self.placement.rollout)

  def make_worker(self, name: str, slot, store: RayWeightStore) -> RayWorker:
    """A worker in `slot` (a planned instance), or, without one, anywhere Ray finds room
    (its actor takes devices of its own node)."""
    if isinstance(slot, ProcessSlot):
      return RayWorker(
        name,
        self.parts.cfg,
        store,
        num_devices=slot.devices,
        mesh_axes=slot.mesh,
        actor_options=slot.actor_options,
      )
    cores = self._worker_cores
    core = [cores[next(self._made) % len(cores)]] if cores else None
    return RayWorker(
      name,
      self.parts.cfg,
      store,
      num_devices=self._devices_per_worker,
      mesh_axes=dict(self.parts.placement.rollout_mesh.shape),
      cores=core,
    )


def core_split() -> tuple[list[int], list[int]]:
  """(learner's cores, rollout workers' cores) for `loop.ray_pin_cores`: halves of the cores
  this process may use."""
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    raise ConfigError(
      f"config.loop.ray_pin_cores needs at least 2 CPU cores to give the learner and the "
      f"rollout workers their own; this process may use {len(cores)}. Turn it off."
    )
  half = len(cores) // 2
  return cores[:half], cores[half:]
