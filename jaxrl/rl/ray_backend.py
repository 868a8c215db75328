"""The `ray` backend of the asynchronous loop: each rollout worker is a Ray actor (its own
process, its own JAX runtime and devices), and the weight store is an actor all of them reach.

The controller does not know which backend runs: `RayWorker` answers to the same calls as
`LocalWorker` (`start`, `submit`, `set_min_version`, `preempt`, `kill`, `alive`, `join`,
`capacity`) and forwards the actor's events into the controller's queue. Inside the actor the
loop is `LocalWorker`'s, reading weights through `RemoteStore`, which turns any failure to reach
the store actor into `StoreUnreachable`. Ray is the optional extra `ray`.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import ray

from jaxrl.config import ExperimentConfig
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

  def __init__(self, name: str, cfg: ExperimentConfig, store_actor, num_devices: int):
    import jax

    from jaxrl.data.tokenizer import TOKENIZERS
    from jaxrl.model import Model
    from jaxrl.rollout.paged import PagedEngine
    from jaxrl.sharding import STAGE_RULES, make_mesh

    tokenizer = TOKENIZERS[cfg.tokenizer]()
    devices = jax.devices()[:num_devices]
    engine = PagedEngine(
      Model(cfg.model),
      make_mesh(devices, {"data": -1}),
      STAGE_RULES["rollout"],
      eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id,
      config=cfg.rollout.paged,
    )
    self.events: queue.Queue = queue.Queue()
    self.worker = LocalWorker(
      name,
      engine,
      RemoteStore(store_actor),
      self.events,
      partial_rollouts=cfg.loop.partial_rollouts,
    )
    self.worker.start()

  def submit(self, assignments: list[Assignment]) -> None:
    self.worker.submit(assignments)

  def set_min_version(self, version: int) -> None:
    self.worker.set_min_version(version)

  def preempt(self) -> None:
    self.worker.preempt()

  def drain(self, wait_s: float) -> tuple[list, bool]:
    """Events so far (waiting up to `wait_s` for the first) and whether the worker runs."""
    out = []
    try:
      out.append(self.events.get(timeout=wait_s))
      while True:
        out.append(self.events.get_nowait())
    except queue.Empty:
      pass
    return out, self.worker.alive


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
    actor_options: dict[str, Any] | None = None,
    poll_s: float = 0.05,
  ):
    """`actor_options` go to `RolloutActor.options` (e.g. `resources`, `label_selector` or
    `accelerator_type` to place the worker on a node with the right accelerators)."""
    self.name = name
    self.events = events
    self.capacity = 2 * cfg.rollout.paged.max_running
    self.predicted_tokens_per_s = None  # its devices are the remote node's: unknown here
    self.poll_s = poll_s
    options = {"max_concurrency": 4, "num_cpus": 0} | (actor_options or {})
    self._actor = RolloutActor.options(**options).remote(name, cfg, store.actor, num_devices)
    self._pump = threading.Thread(target=self._forward, name=f"ray-{name}", daemon=True)
    self._killed = False

  def start(self) -> None:
    self._pump.start()

  def _forward(self) -> None:
    """Moves the actor's events into the controller's queue until the actor is gone."""
    while not self._killed:
      try:
        events, running = ray.get(self._actor.drain.remote(self.poll_s))
      except ray.exceptions.RayError as e:
        if not self._killed:
          log.warning("Rollout actor %s is gone: %s", self.name, e)
        return
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
