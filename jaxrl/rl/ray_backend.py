"""The `ray` backend of the asynchronous loop: each rollout worker and the learner is one Ray
actor or a gang of them (their own processes, JAX runtimes and devices), and the weight store
is an actor all of them reach.

The controller does not know which backend runs: `RayWorker` (`ray_rollout`) answers to the
same calls as `LocalWorker` (`start`, `submit`, `set_min_version`, `preempt`, `kill`, `alive`,
`join`, `capacity`) and forwards its rollout instance's events into the controller's queue; an
instance is one process or `rollout.num_processes` of them with one mesh. The learner is one
actor or a gang of them (`ray_learner`, `train.num_processes`), publishing its shards to the
store actor directly. Ray is the optional extra `ray`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jaxrl.config import ConfigError
from jaxrl.rl.backends import LearnerLost
from jaxrl.rl.ray_cluster import ProcessSlot, RayPlacement, replan_placement
from jaxrl.rl.ray_learner import RayLearner
from jaxrl.rl.ray_rollout import RayWorker
from jaxrl.rl.stages import JobParts, rollout_device_groups
from jaxrl.rl.timeline import StageTimeline
from jaxrl.rl.weights import WeightStore, from_wire, to_wire

log = logging.getLogger(__name__)


@ray.remote
class WeightStoreActor:
  """The versioned store as a Ray actor (host arrays; readers re-shard onto their meshes)."""

  def __init__(self):
    self._store = WeightStore()

  def publish(self, params, version: int) -> None:
    self._store.publish(from_wire(params), version)

  def publish_part(self, version: int, part: int, num_parts: int, shards) -> None:
    self._store.publish_part(version, part, num_parts, shards)

  def pull(self, have: int):
    """(version, params) in wire form (`weights.to_wire`): readers take `from_wire` of it."""
    return to_wire(self._store.pull(have))

  def version(self) -> int:
    return self._store.version


class RayWeightStore:
  """The controller's handle on the store actor, with `WeightStore`'s calls."""

  def __init__(self, actor=None, timeout_s: float = 60.0):
    self.actor = actor or WeightStoreActor.remote()
    self.timeout_s = timeout_s

  def publish(self, params, version: int) -> None:
    # Waits until the store holds it: a version is released to workers only once pullable.
    ray.get(self.actor.publish.remote(to_wire(params), version), timeout=self.timeout_s)

  def pull(self, have: int):
    return from_wire(ray.get(self.actor.pull.remote(have), timeout=self.timeout_s))

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


class ActorWatch:
  """Whether Ray actors are still there, asked without waiting: each `lost()` reads each
  actor's answer to its last ping, where it has come (an actor answers once the calls sent
  before the ping have run), and pings it again. The ping of an actor that died (its process
  killed, its node lost) fails as soon as Ray knows, queued or not."""

  def __init__(self, actors: dict[str, ray.actor.ActorHandle]):
    self.actors = actors
    self._pings: dict[str, ray.ObjectRef] = {}

  def lost(self) -> str:
    """Which actor is gone and why; "" while each has answered or is still busy."""
    for name, actor in self.actors.items():
      ping = self._pings.get(name)
      if ping is not None:
        if not ray.wait([ping], timeout=0)[0]:
          continue
        try:
          ray.get(ping)
        except ray.exceptions.RayActorError as e:
          return f"the {name} is gone ({type(e).__name__}: {str(e).splitlines()[0]})"
      self._pings[name] = actor.__ray_ready__.remote()
    return ""


class RayBackend:
  """The `ray` backend (`backends.Backend`): the learner, the store and each rollout worker as
  Ray actors (a worker of `rollout.num_processes` processes each). With `loop.ray_pin_cores`
  the learner's actor and the workers' get disjoint halves of this machine's cores (one-machine
  runs). With a `placement` (a plan for the Ray cluster, `ray_cluster.plan_placement`) the
  learner's processes and one worker per planned rollout instance go to the nodes of the pools
  the plan chose, with its meshes."""

  CLUSTER_CHECK_S = 2.0  # how often `replan_rollout` reads the Ray cluster's nodes
  LIVENESS_CHECK_S = 2.0  # how often `raise_if_lost` pings the learner's and store's actors

  def __init__(self, parts: JobParts, placement: RayPlacement | None = None):
    self.parts = parts
    self.placement = placement
    self._next_check = 0.0
    self._next_liveness_check = 0.0
    self._learner_node: str | None = None  # the node of the learner's rank 0, once made
    self._watch: tuple[object, object, ActorWatch] | None = None  # (learner, store, watch)
    pin = parts.cfg.loop.ray_pin_cores
    self._learner_cores, self._worker_cores = core_split() if pin else (None, None)
    self._made = itertools.count()
    self._device_groups = rollout_device_groups(parts)
    self._devices_per_worker = len(self._device_groups[0])
    processes = parts.cfg.rollout.num_processes
    if placement is None and self._devices_per_worker % processes:
      # Before any actor starts (a plan's instances are checked by `plan_placement`).
      raise ConfigError(
        f"config.rollout.num_processes={processes}: a rollout worker has "
        f"{self._devices_per_worker} devices (the rollout mesh's "
        f"{len(self._device_groups) * self._devices_per_worker} over {len(self._device_groups)} "
        f"worker(s)), which {processes} processes cannot hold equally; use a divisor of "
        f"{self._devices_per_worker}, or change config.loop.rollout_workers."
      )

  def make_learner(self, model) -> RayLearner:
    del model  # the actor builds its own from the config
    cfg = self.parts.cfg
    if self.placement is not None:
      slots = self.placement.learner
      learner = RayLearner(
        cfg,
        self.placement.train_mesh,
        num_processes=len(slots),
        rank_options=[s.actor_options for s in slots],
      )
    else:
      shape = dict(self.parts.placement.train_mesh.shape)
      learner = RayLearner(
        cfg, shape, num_processes=cfg.train.num_processes, cores=self._learner_cores
      )
    self._learner_node = learner.node_ids()[0]
    return learner

  def make_store(self) -> RayWeightStore:
    """The store actor, on the node of the learner's first process once a learner was made
    (Ray's choice otherwise, or if that node is full): placed by Ray alone it could land on a
    rollout node, often preemptible capacity, whose loss then took the store and stopped the
    job's weights (every worker's next version) with it."""
    if self._learner_node is None:
      return RayWeightStore()
    beside = NodeAffinitySchedulingStrategy(self._learner_node, soft=True)
    return RayWeightStore(WeightStoreActor.options(num_cpus=0, scheduling_strategy=beside).remote())

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

  def raise_if_lost(self, learner: RayLearner, store: RayWeightStore) -> None:
    """Raises `LearnerLost` once a learner process or the store actor is gone (pinged at most
    every `LIVENESS_CHECK_S`, without waiting), after killing what is left of both. Without
    it a loop waiting for rollouts learned of a lost learner only at its next call, and not at
    all while the workers waited for a version the lost learner or store never delivered: the
    job then waited forever."""
    now = time.monotonic()
    if now < self._next_liveness_check:
      return
    self._next_liveness_check = now + self.LIVENESS_CHECK_S
    if self._watch is None or self._watch[0] is not learner or self._watch[1] is not store:
      ranks = {f"learner process {r}": actor for r, actor in enumerate(learner.actors)}
      self._watch = (learner, store, ActorWatch({**ranks, "weight store actor": store.actor}))
    why = self._watch[2].lost()
    if why:
      learner.kill()
      ray.kill(store.actor, no_restart=True)
      raise LearnerLost(f"{why}; the learner's processes and the weight store were stopped")

  def make_worker(self, name: str, slot, store: RayWeightStore) -> RayWorker:
    """A worker in `slot` (a planned instance), or, without one, anywhere Ray finds room
    (its actor takes devices of its own node)."""
    if isinstance(slot, ProcessSlot):
      return RayWorker(
        name,
        self.parts.cfg,
        store,
        num_devices=slot.devices,
        num_processes=slot.processes,
        mesh_axes=slot.mesh,
        actor_options=slot.actor_options,
      )
    cores = self._worker_cores
    core = [cores[next(self._made) % len(cores)]] if cores else None
    processes = self.parts.cfg.rollout.num_processes
    return RayWorker(
      name,
      self.parts.cfg,
      store,
      num_devices=self._devices_per_worker // processes,
      num_processes=processes,
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
