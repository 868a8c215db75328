"""The learner as Ray actors: one process, or a gang of `train.num_processes` processes that
form one JAX world (`jax.distributed`) with one training mesh over all their devices, so FSDP
and tensor parallelism span processes (and, on a Ray cluster, hosts).

Each process of the gang (`LearnerActor`, rank r of P) holds devices of its own; rank 0 is the
coordinator. Every rank runs the same program on the same inputs (SPMD): the controller's
handle, `RayLearner`, sends each call to every rank and takes rank 0's answer. Collectives go
over gloo on CPU and over the accelerators' own links otherwise.

Weights leave as shards: each rank sends the pieces it owns (one replica of each) to the store
actor, which makes a version visible only once all P parts are in
(`ray_backend.WeightStoreActor.publish_part`): no learner process gathers the model, and no
reader sees a torn version. Reading `params` or `opt_state` (checkpoints, evaluation) gathers
them to the host of every rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from typing import Any

import jax
import ray

from jaxrl.compile_cache import use_compile_cache
from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.model import copy_params
from jaxrl.rl.backends import LearnerLost
from jaxrl.rl.timeline import LEARNER_LANE, ForwardingTimeline, StageTimeline
from jaxrl.rl.weights import from_wire, owned_shards, to_wire


def pin_cores(cores: list[int] | None) -> None:
  """Runs this process on `cores` only; called before JAX starts, so that the threads XLA
  creates inherit it. On a CPU machine this gives each stage compute of its own, as separate
  accelerators would."""
  if cores:
    os.sched_setaffinity(0, cores)


def local_devices(count: int, what: str):
  """This actor process's first `count` devices (on a CPU node, `count` simulated ones)."""
  # Only takes effect before the process first uses a device; a no-op on accelerator nodes.
  with contextlib.suppress(RuntimeError):
    jax.config.update("jax_num_cpu_devices", max(count, 1))
  devices = jax.devices()
  if len(devices) < count:
    raise ValueError(f"{what} needs {count} devices; this Ray actor's process has {len(devices)}.")
  return devices[:count]


def coordinator_address() -> str:
  """host:port for a gang's JAX coordinator: a free port of this (rank 0's) node."""
  with socket.socket() as s:
    s.bind(("", 0))
    port = s.getsockname()[1]
  return f"{ray.util.get_node_ip_address()}:{port}"


def join_jax_world(
  coordinator: str, num_processes: int, rank: int, devices_per_process: int, timeout_s: int
) -> list:
  """Joins this process to the JAX world of a gang (rank `rank` of `num_processes`, with
  `devices_per_process` devices each) at `coordinator`; returns every rank's devices, in rank
  order. JAX ends the process if the others do not join within `timeout_s`."""
  # CPU nodes: this process's share of simulated devices, and collectives between processes
  # over gloo (on accelerator nodes neither applies).
  with contextlib.suppress(RuntimeError):
    jax.config.update("jax_num_cpu_devices", devices_per_process)
  with contextlib.suppress(RuntimeError, AttributeError):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Programs run in dispatch order on CPU: dispatched asynchronously, two programs could start
  # their collectives in different orders in two processes and wait on each other for good
  # (seen: a gang hung in the eager op after an update on a loaded machine).
  with contextlib.suppress(RuntimeError, AttributeError):
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  jax.distributed.initialize(coordinator, num_processes, rank, initialization_timeout=timeout_s)
  return jax.devices()


def _host_copy(tree):
  """Host arrays of `tree`: straight from the devices in one process; gathered from every
  process's shards in a gang (a collective: every rank calls it)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)


@ray.remote
class LearnerActor:
  """One process of the learner: rank `rank` of `num_processes`. `build` joins the gang's JAX
  world and makes `stages.make_learner` on the training mesh over every rank's devices."""

  def __init__(
    self,
    cfg: ExperimentConfig,
    mesh_shape: dict[str, int],
    cores: list | None,
    rank: int = 0,
    num_processes: int = 1,
  ):
    pin_cores(cores)
    use_compile_cache(cfg.compile_cache_dir)
    self.cfg, self.mesh_shape = cfg, mesh_shape
    self.rank, self.num_processes = rank, num_processes
    self.learner = None
    self._sft = None  # (learning rate, SupervisedTrainer) of the warm-up
    self.timeline = ForwardingTimeline(compile_lane=LEARNER_LANE)  # its compilations

  def coordinator_address(self) -> str:
    """host:port for the gang's JAX coordinator, on this (rank 0's) node."""
    return coordinator_address()

  def build(self, coordinator: str | None, timeout_s: int) -> bool:
    """Joins the JAX world at `coordinator` (a gang) and builds the learner; raises what the
    build raised (a bad config, too few devices)."""
    from jaxrl.model import Model
    from jaxrl.rl.policy import make_tokenizer, model_config
    from jaxrl.rl.stages import make_learner
    from jaxrl.sharding import make_mesh

    total = math.prod(self.mesh_shape.values())
    per_process = total // self.num_processes  # `RayLearner` checked that it divides
    if self.num_processes > 1:
      devices = join_jax_world(coordinator, self.num_processes, self.rank, per_process, timeout_s)
      if len(devices) < total:
        raise ValueError(f"The learner gang has {len(devices)} devices; its mesh needs {total}.")
      devices = devices[:total]
    else:
      devices = local_devices(total, "The learner actor")
    model = Model(model_config(self.cfg, make_tokenizer(self.cfg)))
    self.learner = make_learner(self.cfg, model, make_mesh(devices, self.mesh_shape))
    return True

  def cores(self) -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))

  def node_id(self) -> str:
    """The Ray node this process runs on."""
    return ray.get_runtime_context().get_node_id()

  def spans(self) -> list:
    return self.timeline.drain()

  def update(self, batch) -> tuple[dict, list]:
    """The update's metrics, and the spans recorded since the last call: one round trip."""
    return jax.device_get(self.learner.update(batch)), self.timeline.drain()

  def precompile(self, batch_size: int, lengths: list[int]) -> int:
    return self.learner.precompile(batch_size, lengths)

  def compile_ahead(self, batch_size: int, lengths: list[int]) -> None:
    self.learner.compile_ahead(batch_size, lengths)  # the actor's next update waits for it

  def stop_compiling_ahead(self) -> None:
    self.learner.stop_compiling_ahead()

  def publish_part(self, store_actor, version: int, dtypes=None) -> None:
    """Sends the shards this process owns to the store actor (not through the controller),
    cast to `dtypes` on its devices first (bf16 readers: half the bytes)."""
    with self.timeline.span(LEARNER_LANE, "weight-sync"):
      params = self.learner.params
      shards = owned_shards(params if dtypes is None else copy_params(params, dtypes))
      ray.get(store_actor.publish_part.remote(version, self.rank, self.num_processes, shards))

  def get(self, name: str):
    return to_wire(_host_copy(getattr(self.learner, name)))  # bf16 as bits: no pickled copy

  def set_state(self, params=None, opt_state=None, ref_params=None) -> None:
    """Host arrays onto the shardings of the learner's own (a checkpoint restore); every rank
    is given the whole arrays (in `to_wire` form) and keeps its shards."""
    params, opt_state, ref_params = from_wire((params, opt_state, ref_params))
    onto_current = lambda new, current: jax.tree.map(  # noqa: E731
      lambda x, cur: jax.device_put(x, cur.sharding), new, current
    )
    if params is not None:
      self.learner.params = onto_current(params, self.learner.params)
    if opt_state is not None:
      self.learner.opt_state = onto_current(opt_state, self.learner.opt_state)
    if ref_params is not None:
      self.learner.ref_params = ref_params  # its setter puts them on the parameters' shardings

  def reset_reference(self) -> None:
    self.learner.reset_reference()

  def supervised_step(self, learning_rate: float, tokens_bt, mask_bt) -> dict:
    from jaxrl.train.sft import SupervisedTrainer

    if self._sft is None or self._sft[0] != learning_rate:
      self._sft = (learning_rate, SupervisedTrainer(self.learner, learning_rate))
    return jax.device_get(self._sft[1].step(tokens_bt, mask_bt))


class RayLearner:
  """The controller's handle on the learner's actors (`backends.PolicyLearner`).

  `params` and `opt_state` read as host arrays and may be assigned (a checkpoint restore)."""

  def __init__(
    self,
    cfg: ExperimentConfig,
    mesh_shape: dict[str, int],
    *,
    num_processes: int = 1,
    cores: list[int] | None = None,
    actor_options: dict[str, Any] | None = None,
    rank_options: list[dict[str, Any]] | None = None,
    coordinator: str | None = None,
    timeout_s: float = 3600.0,
    join_timeout_s: int = 300,
  ):
    """`num_processes`: the gang's size (`train.num_processes`), each process holding an equal
    share of the mesh's devices. `actor_options` go to `LearnerActor.options` (e.g.
    `num_gpus`, `resources` or `label_selector` to place the processes on nodes with the right
    accelerators), `rank_options` per process (a plan's placement, `ray_cluster`, over
    `actor_options`); `cores` pins each process to these CPU cores; `coordinator`: host:port
    of the gang's JAX coordinator, reachable from every learner node (default: rank 0's node,
    a free port); `join_timeout_s` bounds the wait for every rank to join the JAX world."""
    total = math.prod(mesh_shape.values())
    if total % num_processes:
      raise ConfigError(
        f"config.train.num_processes={num_processes}: the training mesh {mesh_shape} has "
        f"{total} devices, which {num_processes} processes cannot hold equally; use a "
        f"divisor of {total}."
      )
    self.timeout_s = timeout_s
    self.timeline: StageTimeline | None = None  # set by the controller; gets rank 0's spans
    self._publishing: list = []  # the publication still running in the actors, if any
    if rank_options is not None and len(rank_options) != num_processes:
      raise ValueError(f"{len(rank_options)} rank_options for {num_processes} processes.")
    options = [
      {"num_cpus": 0} | (actor_options or {}) | (rank_options[r] if rank_options else {})
      for r in range(num_processes)
    ]
    self._actors = [
      LearnerActor.options(**options[rank]).remote(cfg, mesh_shape, cores, rank, num_processes)
      for rank in range(num_processes)
    ]
    # Construction errors (a bad config, too few devices) surface here, not at the first step.
    try:
      if num_processes > 1 and coordinator is None:
        coordinator = self._get(self._actors[0].coordinator_address.remote())
      self._all(lambda a: a.build.remote(coordinator, join_timeout_s))
    except LearnerLost as e:
      # JAX ends a process that cannot reach the coordinator (or whose peer died) when the
      # join times out: Ray then only knows that the actor died.
      raise RuntimeError(
        f"A learner process died while the {num_processes} processes joined one JAX world at "
        f"coordinator {coordinator} (join timeout {join_timeout_s} s): the coordinator was "
        f"unreachable from a learner node, or a process failed to start. Check that every "
        f"learner node reaches {coordinator}. Ray: {e}"
      ) from None
    except BaseException:
      self.kill()
      raise

  def _get(self, ref):
    try:
      return ray.get(ref, timeout=self.timeout_s)
    except ray.exceptions.RayTaskError as e:
      raise e.as_instanceof_cause() from None
    except ray.exceptions.RayActorError as e:
      # A process of the learner is gone (its node lost, killed, out of memory): the others
      # cannot go on without it (their collectives wait for it).
      self.kill()
      raise LearnerLost(f"A learner process died: {e}") from None

  def _wait_all(self, refs: list) -> list:
    """Every rank's result; the first error any rank raised, as soon as it is raised (the
    other ranks may be waiting for it in a collective)."""
    deadline = time.monotonic() + self.timeout_s
    pending = list(refs)
    while pending:
      done, pending = ray.wait(pending, timeout=max(deadline - time.monotonic(), 0))
      if not done:
        raise TimeoutError(f"The learner's processes did not answer in {self.timeout_s:.0f} s.")
      for ref in done:
        self._get(ref)
    return [self._get(ref) for ref in refs]

  def _all(self, call):
    """`call(actor)` on every rank (the SPMD programs must all run); rank 0's result."""
    self._wait_published()
    return self._wait_all([call(a) for a in self._actors])[0]

  def _wait_published(self) -> None:
    """Waits for the last `publish_to` to reach the store, and raises what it raised."""
    refs, self._publishing = self._publishing, []
    if refs:
      self._wait_all(refs)

  def update(self, batch) -> dict:
    batch_ref = ray.put(batch)  # sent once, read by every rank
    metrics, spans = self._all(lambda a: a.update.remote(batch_ref))
    if self.timeline is not None:
      for span in spans:
        self.timeline.add(*span)
    return metrics

  def precompile(self, batch_size: int, lengths: list[int]) -> int:
    count = self._all(lambda a: a.precompile.remote(batch_size, lengths))
    self._all(lambda a: a.spans.remote())  # its compilations came before the run: not stalls
    return count

  def compile_ahead(self, batch_size: int, lengths: list[int] = ()) -> None:
    self._all(lambda a: a.compile_ahead.remote(batch_size, list(lengths)))

  def stop_compiling_ahead(self) -> None:
    for actor in self._actors:  # not waited for: an actor already gone compiles nothing either
      actor.stop_compiling_ahead.remote()

  def publish_to(
    self, store, version: int, *, lend: bool = False, dtypes=None, on_device: bool = False
  ) -> None:
    """Publishes the weights as `version` from the actors straight to the Ray backend's store
    actor (`ray_backend.RayWeightStore`), each rank its own shards cast to `dtypes`, as copies
    the store owns (`lend` and `on_device` are moot across processes). It returns at once: the
    actors publish while the controller assembles the next batch (they run calls in order, so
    the next update starts after the publication). Workers that need the version wait for it
    in the store (`set_min_version`); `store.wait_for` waits for it here."""
    del lend, on_device
    self._wait_published()
    self._publishing = [a.publish_part.remote(store.actor, version, dtypes) for a in self._actors]

  @property
  def params(self):
    return from_wire(self._all(lambda a: a.get.remote("params")))

  @params.setter
  def params(self, params) -> None:
    params_ref = ray.put(to_wire(params))
    self._all(lambda a: a.set_state.remote(params=params_ref))

  @property
  def ref_params(self):
    return from_wire(self._all(lambda a: a.get.remote("ref_params")))

  @ref_params.setter
  def ref_params(self, ref_params) -> None:
    ref = ray.put(to_wire(ref_params))
    self._all(lambda a: a.set_state.remote(ref_params=ref))

  def reset_reference(self) -> None:
    """The actors' current parameters become their KL reference (no round trip of weights)."""
    self._all(lambda a: a.reset_reference.remote())

  @property
  def opt_state(self):
    return from_wire(self._all(lambda a: a.get.remote("opt_state")))

  @opt_state.setter
  def opt_state(self, opt_state) -> None:
    opt_ref = ray.put(to_wire(opt_state))
    self._all(lambda a: a.set_state.remote(opt_state=opt_ref))

  def supervised_trainer(self, learning_rate: float) -> _RemoteSupervised:
    """The warm-up's trainer, run in the actors on the learner's parameters."""
    return _RemoteSupervised(self, learning_rate)

  def cores(self) -> list[int]:
    """The CPU cores rank 0's process may run on."""
    return self._get(self._actors[0].cores.remote())

  def node_ids(self) -> list[str]:
    """The Ray node each rank runs on."""
    return [self._get(a.node_id.remote()) for a in self._actors]

  @property
  def actors(self) -> list:
    """Its processes' actors, rank 0 first."""
    return list(self._actors)

  def kill(self) -> None:
    for actor in self._actors:
      ray.kill(actor, no_restart=True)


class _RemoteSupervised:
  def __init__(self, learner: RayLearner, learning_rate: float):
    self.learner = learner
    self.learning_rate = learning_rate

  def step(self, tokens_bt, mask_bt) -> dict:
    rate = self.learning_rate
    return self.learner._all(lambda a: a.supervised_step.remote(rate, tokens_bt, mask_bt))
