"""Backends: what runs a job's learner, weight store and rollout workers.

- `local`: the learner in this process, the store in its memory, each rollout worker a thread
  of this process on its own slice of the rollout devices (`workers.LocalWorker`).
- `ray`: the learner, the store and each rollout worker as Ray actors (`ray_backend`, the
  optional `ray` extra), placed by Ray.

A backend makes the three pieces; the controller drives them through their protocols
(`PolicyLearner`, `VersionedStore`, `workers.RolloutWorker`), never by asking which backend
made them. `BACKENDS` maps
`config.loop.backend` to a backend's maker; the synchronous loop runs on `local`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from jaxrl.config import ConfigError
from jaxrl.model import Model, Params
from jaxrl.rl.policy import make_rollout_engine, rollout_worker_mesh
from jaxrl.rl.stages import JobParts, make_learner, rollout_device_groups
from jaxrl.rl.weights import WeightStore
from jaxrl.rl.workers import LocalWorker, RolloutWorker
from jaxrl.scheduler.local import worker_tokens_per_s
from jaxrl.train.batch import TrainBatch
from jaxrl.train.sft import SupervisedTrainer


class LearnerLost(RuntimeError):
  """A process of the learner, or the weight store, is gone; the run goes on from the last
  checkpoint with a new learner and store (`job.run`, `config.loop.learner_restarts`)."""


class VersionedStore(Protocol):
  """What the loop and the workers need of the weight store (`weights.WeightStore` here, the
  store actor's handle `ray_backend.RayWeightStore`); ownership rule: `weights.py`."""

  def publish(self, params: Params, version: int) -> None:
    """Makes `params` the newest version (versions increase)."""

  def pull(self, have: int) -> tuple[int, Params] | None:
    """The newest (version, params) if newer than `have`, else None."""

  def wait_for(self, version: int) -> None:
    """Returns once the store holds `version` or newer."""

  @property
  def version(self) -> int:
    """The newest version held; -1 before the first."""


class PolicyLearner(Protocol):
  """What the loop needs of the learner (`train.Learner` here, the learner actor's handle
  `ray_backend.RayLearner`). `params`, `opt_state` and `ref_params` (the KL reference, None
  without a KL term) read as arrays the caller may keep and may be assigned (a checkpoint
  restore)."""

  params: Params
  opt_state: Any
  ref_params: Params | None

  def reset_reference(self) -> None:
    """Makes the current parameters the KL reference (no-op without a KL term)."""

  def update(self, batch: TrainBatch) -> dict:
    """The optimizer updates of one step on `batch`; their metrics."""

  def publish_to(
    self,
    store: VersionedStore,
    version: int,
    *,
    lend: bool = False,
    dtypes: Params | None = None,
    on_device: bool = False,
  ) -> None:
    """Publishes the weights to `store` as `version` (the store's ownership rule): with
    `lend` the live buffers (a reader in this process that takes them before the next update),
    else a copy cast to `dtypes` (the readers' parameter dtypes, a tree like the parameters';
    None: the learner's) on the learner's devices, kept there with `on_device` where the
    readers are in its process, else sent through the host."""

  def precompile(self, batch_size: int, lengths: list[int]) -> int:
    """Compiles the update for the batch shapes a run will meet; how many it compiled."""

  def compile_ahead(self, batch_size: int, lengths: list[int] = ()) -> None:
    """Starts compiling the update's programs for these lengths (packed: its rows) in the
    background, running nothing; the next update waits for them."""

  def stop_compiling_ahead(self) -> None:
    """Skips `compile_ahead`'s programs not begun (its owner is done with it)."""


class Backend(Protocol):
  """Makes a job's learner, weight store and rollout workers."""

  def make_learner(self, model: Model) -> PolicyLearner:
    """The learner on the placement's training mesh."""

  def make_store(self) -> VersionedStore:
    """The versioned weight store the learner publishes to and the workers pull from."""

  def attach_learner(self, learner: PolicyLearner, timeline: Any) -> None:
    """Where the learner's own timeline spans go (a learner in another process records its
    updates and compilations there); the controller records a local learner's itself."""

  def worker_slots(self) -> list[Sequence[jax.Device] | None]:
    """One entry per rollout worker of `config.loop.rollout_workers`: the devices it runs on
    (None where the backend finds them itself)."""

  def supervised_trainer(self, learner: PolicyLearner, learning_rate: float) -> Any:
    """The warm-up's trainer (`step(tokens_bt, mask_bt) -> metrics`) of `learner`'s weights,
    run where they live."""

  def make_worker(
    self, name: str, devices: Sequence[jax.Device] | None, store: VersionedStore
  ) -> RolloutWorker:
    """A rollout worker named `name` on `devices` (an entry of `worker_slots`, or any devices
    of the rollout mesh for a worker added later), pulling weights from `store`."""

  def replan_rollout(self) -> list | None:
    """After the cluster changed (nodes joined or were lost): the rollout slots the scheduler's
    re-planning chose, one per worker the controller should run; None while nothing changed
    (always, for a backend whose devices are fixed)."""

  def raise_if_lost(self, learner: PolicyLearner, store: VersionedStore) -> None:
    """Raises `LearnerLost` once a process of `learner` or `store` is gone, without waiting
    for them (the loop asks while it waits for rollouts); never, for a backend that runs them
    in this process."""


class LocalBackend:
  """The learner in this process; rollout workers as threads on slices of its devices."""

  def __init__(self, parts: JobParts):
    self.parts = parts

  def make_learner(self, model: Model):
    return make_learner(self.parts.cfg, model, self.parts.placement.train_mesh)

  def make_store(self) -> WeightStore:
    return WeightStore()

  def attach_learner(self, learner, timeline) -> None:
    del learner, timeline  # in this process: the controller's spans cover it

  def supervised_trainer(self, learner, learning_rate: float) -> SupervisedTrainer:
    return SupervisedTrainer(learner, learning_rate)

  def worker_slots(self) -> list[Sequence[jax.Device] | None]:
    return rollout_device_groups(self.parts)

  def replan_rollout(self) -> list | None:
    return None  # this process's devices do not come and go

  def raise_if_lost(self, learner, store) -> None:
    del learner, store  # in this process: they go only with it

  def make_worker(self, name: str, devices, store) -> LocalWorker:
    p = self.parts
    if devices is None:
      raise ValueError(f"A local rollout worker ({name}) needs the devices it runs on.")
    mesh = rollout_worker_mesh(devices, dict(p.placement.rollout_mesh.shape))
    return LocalWorker(
      name,
      make_rollout_engine(p.cfg, p.rollout_model, mesh, p.tokenizer),
      store,
      None,  # the controller attaches its event queue (`RolloutWorker.attach`)
      partial_rollouts=p.cfg.loop.partial_rollouts,
      predicted_tokens_per_s=worker_tokens_per_s(p.cfg, dict(mesh.shape), p.prompt_len),
    )


def init_ray(address: str) -> None:
  """Connects to the Ray cluster at `address` (`config.loop.ray_address`; "" starts one in this
  machine), unless this process is connected already."""
  import ray

  if not ray.is_initialized():
    ray.init(address=address or None, include_dashboard=False, log_to_driver=False)


def _ray(parts: JobParts) -> Backend:
  """The Ray backend (imported only when asked for: Ray is an optional extra)."""
  try:
    import ray

    from jaxrl.rl import ray_backend, ray_cluster
  except ImportError:
    raise ConfigError(
      "config.loop.backend='ray' needs Ray: pip install 'jaxrl[ray]' (or set loop.backend='local')."
    ) from None
  init_ray(parts.cfg.loop.ray_address)
  placement = None
  if parts.cfg.loop.ray_cluster:
    placement = ray_cluster.placement_for_job(parts.cfg, parts.prompt_len, ray.nodes())
  return ray_backend.RayBackend(parts, placement)


BACKENDS: dict[str, Callable[[JobParts], Backend]] = {"local": LocalBackend, "ray": _ray}


def make_backend(name: str, parts: JobParts) -> Backend:
  """The backend `config.loop.backend` names (its config check lists the same names)."""
  if name not in BACKENDS:
    raise ConfigError(f"config.loop.backend={name!r}: use one of {sorted(BACKENDS)}.")
  return BACKENDS[name](parts)
