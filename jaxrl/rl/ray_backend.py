"""The `ray` backend of the asynchronous loop: each rollout worker and the learner is a Ray
actor (its own process, its own JAX runtime and devices), and the weight store is an actor all
of them reach.

The controller does not know which backend runs: `RayWorker` answers to the same calls as
`LocalWorker` (`start`, `submit`, `set_min_version`, `preempt`, `kill`, `alive`, `join`,
`capacity`) and forwards the actor's events into the controller's queue. Inside the actor the
loop is `LocalWorker`'s, reading weights through `RemoteStore`, which turns any failure to reach
the store actor into `StoreUnreachable`. `RayLearner` answers to the `Learner` calls the
controller makes (`update`, `publish_to`, `params`, `opt_state`) and runs them in a
`LearnerActor`, which publishes weights to the store actor directly; parameters and optimizer
state cross as host arrays, and the actor re-shards them onto its mesh. Ray is the
optional extra `ray`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
from typing import Any

import jax
import ray

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.rl.stages import JobParts, rollout_device_groups
from jaxrl.rl.timeline import LEARNER_LANE, ForwardingTimeline, StageTimeline
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
    _pin(cores)
    from jaxrl.model import Model
    from jaxrl.rl import policy

    tokenizer = policy.make_tokenizer(cfg)
    devices = _local_devices(num_devices, f"Rollout worker {name}")
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

  def set_min_version(self, version: int) -> None:
    self.worker.set_min_version(version)

  def preempt(self) -> None:
    self.worker.preempt()

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


def _pin(cores: list[int] | None) -> None:
  """Runs this process on `cores` only; called before JAX starts, so that the threads XLA
  creates inherit it. On a CPU machine this gives each stage compute of its own, as separate
  accelerators would."""
  if cores:
    os.sched_setaffinity(0, cores)


def _local_devices(count: int, what: str):
  """This actor process's first `count` devices (on a CPU node, `count` simulated ones)."""
  # Only takes effect before the process first uses a device; a no-op on accelerator nodes.
  with contextlib.suppress(RuntimeError):
    jax.config.update("jax_num_cpu_devices", max(count, 1))
  devices = jax.devices()
  if len(devices) < count:
    raise ValueError(f"{what} needs {count} devices; this Ray actor's process has {len(devices)}.")
  return devices[:count]


@ray.remote
class LearnerActor:
  """The learner's process: `stages.make_learner` on this process's devices, in the training
  mesh's shape. Returns host arrays, so what it sends needs no device on the other side."""

  def __init__(self, cfg: ExperimentConfig, mesh_shape: dict[str, int], cores: list | None):
    _pin(cores)
    import math

    from jaxrl.model import Model
    from jaxrl.rl.policy import make_tokenizer, model_config
    from jaxrl.rl.stages import make_learner
    from jaxrl.sharding import make_mesh

    self._sft = None  # (learning rate, SupervisedTrainer) of the warm-up
    self.timeline = ForwardingTimeline(compile_lane=LEARNER_LANE)  # its compilations
    # Ray reports an error raised here only as "the actor died"; `ready` raises it instead.
    self._init_error: Exception | None = None
    try:
      devices = _local_devices(math.prod(mesh_shape.values()), "The learner actor")
      model = Model(model_config(cfg, make_tokenizer(cfg)))
      self.learner = make_learner(cfg, model, make_mesh(devices, mesh_shape))
    except Exception as e:
      self._init_error = e

  def ready(self) -> bool:
    if self._init_error is not None:
      raise self._init_error
    return True

  def cores(self) -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))

  def spans(self) -> list:
    return self.timeline.drain()

  def update(self, batch) -> tuple[dict, list]:
    """The update's metrics, and the spans recorded since the last call: one round trip."""
    return jax.device_get(self.learner.update(batch)), self.timeline.drain()

  def precompile(self, batch_size: int, lengths: list[int]) -> int:
    return self.learner.precompile(batch_size, lengths)

  def publish_to(self, store_actor, version: int) -> None:
    """Sends the weights to the store actor directly, not through the controller's process."""
    with self.timeline.span(LEARNER_LANE, "weight-sync"):
      ray.get(store_actor.publish.remote(jax.device_get(self.learner.params), version))

  def get(self, name: str):
    return jax.device_get(getattr(self.learner, name))

  def set_state(self, params=None, opt_state=None) -> None:
    """Host arrays onto the shardings of the learner's own (a checkpoint restore)."""
    onto_current = lambda new, current: jax.tree.map(  # noqa: E731
      lambda x, cur: jax.device_put(x, cur.sharding), new, current
    )
    if params is not None:
      self.learner.params = onto_current(params, self.learner.params)
    if opt_state is not None:
      self.learner.opt_state = onto_current(opt_state, self.learner.opt_state)

  def supervised_step(self, learning_rate: float, tokens_bt, mask_bt) -> dict:
    from jaxrl.train.sft import SupervisedTrainer

    if self._sft is None or self._sft[0] != learning_rate:
      self._sft = (learning_rate, SupervisedTrainer(self.learner, learning_rate))
    return jax.device_get(self._sft[1].step(tokens_bt, mask_bt))


class RayLearner:
  """The controller's handle on a `LearnerActor`, with the `Learner` calls the loop makes.

  `params` and `opt_state` read as host arrays and may be assigned (a checkpoint restore)."""

  def __init__(
    self,
    cfg: ExperimentConfig,
    mesh_shape: dict[str, int],
    *,
    cores: list[int] | None = None,
    actor_options: dict[str, Any] | None = None,
    timeout_s: float = 3600.0,
  ):
    """`actor_options` go to `LearnerActor.options` (e.g. `num_gpus`, `resources` or
    `label_selector` to place the learner on a node with the right accelerators); `cores`
    pins the actor's process to these CPU cores."""
    self.timeout_s = timeout_s
    self.timeline: StageTimeline | None = None  # set by the controller; gets the actor's spans
    self._publishing = None  # the publication still running in the actor, if any
    options = {"num_cpus": 0} | (actor_options or {})
    self._actor = LearnerActor.options(**options).remote(cfg, mesh_shape, cores)
    # Construction errors (a bad config, too few devices) surface here, not at the first step.
    self._get(self._actor.ready.remote())

  def _get(self, ref):
    try:
      return ray.get(ref, timeout=self.timeout_s)
    except ray.exceptions.RayTaskError as e:
      raise e.as_instanceof_cause() from None

  def wait_published(self) -> None:
    """Waits for the last `publish_to` to reach the store, and raises what it raised."""
    ref, self._publishing = self._publishing, None
    if ref is not None:
      self._get(ref)

  def update(self, batch) -> dict:
    ref = self._actor.update.remote(batch)  # the actor runs it after the publication
    self.wait_published()
    metrics, spans = self._get(ref)
    if self.timeline is not None:
      for span in spans:
        self.timeline.add(*span)
    return metrics

  def precompile(self, batch_size: int, lengths: list[int]) -> int:
    count = self._get(self._actor.precompile.remote(batch_size, lengths))
    self._get(self._actor.spans.remote())  # its compilations came before the run: not stalls
    return count

  def publish_to(self, store, version: int) -> None:
    """Publishes the weights as `version`: from the actor straight to a store actor
    (`RayWeightStore`), otherwise through this process. To a store actor it returns at once:
    the actor publishes while the controller assembles the next batch (it runs calls in
    order, so the next update starts after the publication), and records the span itself.
    Workers that need the version wait for it in the store (`set_min_version`)."""
    self.wait_published()
    if isinstance(store, RayWeightStore):
      self._publishing = self._actor.publish_to.remote(store.actor, version)
    else:
      store.publish(self.params, version)

  @property
  def params(self):
    self.wait_published()
    return self._get(self._actor.get.remote("params"))

  @params.setter
  def params(self, params) -> None:
    self._get(self._actor.set_state.remote(params=params))

  @property
  def opt_state(self):
    self.wait_published()
    return self._get(self._actor.get.remote("opt_state"))

  @opt_state.setter
  def opt_state(self, opt_state) -> None:
    self._get(self._actor.set_state.remote(opt_state=opt_state))

  def supervised_trainer(self, learning_rate: float) -> _RemoteSupervised:
    """The warm-up's trainer, run in the actor on the learner's parameters."""
    return _RemoteSupervised(self, learning_rate)

  def cores(self) -> list[int]:
    """The CPU cores the actor's process may run on."""
    return self._get(self._actor.cores.remote())

  def kill(self) -> None:
    ray.kill(self._actor, no_restart=True)


class _RemoteSupervised:
  def __init__(self, learner: RayLearner, learning_rate: float):
    self.learner = learner
    self.learning_rate = learning_rate

  def step(self, tokens_bt, mask_bt) -> dict:
    ref = self.learner._actor.supervised_step.remote(self.learning_rate, tokens_bt, mask_bt)
    return self.learner._get(ref)


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
  halves of this machine's cores (one-machine runs)."""

  def __init__(self, parts: JobParts):
    self.parts = parts
    pin = parts.cfg.loop.ray_pin_cores
    self._learner_cores, self._worker_cores = core_split() if pin else (None, None)
    self._made = itertools.count()
    groups = rollout_device_groups(parts)
    self._devices_per_worker = len(groups[0])

  def make_learner(self, model) -> RayLearner:
    del model  # the actor builds its own from the config
    shape = dict(self.parts.placement.train_mesh.shape)
    return RayLearner(self.parts.cfg, shape, cores=self._learner_cores)

  def make_store(self) -> RayWeightStore:
    return RayWeightStore()

  def attach_learner(self, learner: RayLearner, timeline: StageTimeline) -> None:
    learner.timeline = timeline  # the actor's spans come back with its results

  def supervised_trainer(self, learner: RayLearner, learning_rate: float):
    return learner.supervised_trainer(learning_rate)  # in the learner's actor

  def worker_slots(self) -> list[None]:
    return [None] * self.parts.cfg.loop.rollout_workers  # Ray places each worker's actor

  def make_worker(self, name: str, devices, store: RayWeightStore) -> RayWorker:
    del devices  # its actor takes devices of its own node
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
