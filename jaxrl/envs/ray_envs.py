"""Environments as Ray actors (`config.env.run_in="ray"`): the CPU nodes of a Ray cluster run
them while the accelerators generate.

Each actor is an environment worker like a process of `jaxrl.envs.remote` (an `EnvHost`, its
own memory cap) and takes the Ray resources `config.env.worker_resources` asks for, so a
cluster can keep environments on nodes of its own (e.g. `{"jaxrl-pool-cpu": 1}` for nodes
started with `ray start --resources='{"jaxrl-pool-cpu": 8}'`). An actor that dies (its node
lost, a crash) loses its environments exactly as a worker process does: their episodes end
"env_error", trajectories kept, and a new actor takes its place for the next environments.
Imported only for that setting: Ray is an optional extra.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Any

import ray

from jaxrl.envs.base import EnvError
from jaxrl.envs.remote import EnvHost, EnvWorkers, Worker, encode_error

log = logging.getLogger(__name__)


@ray.remote(max_restarts=0)
class EnvActor:
  """One environment worker in a Ray actor (async: its calls run concurrently)."""

  def __init__(self, name: str, kwargs: dict, memory_mb: int, threads: int):
    from jaxrl.envs.registry import env_factory

    self.host = EnvHost(env_factory(name, kwargs), threads)
    self.host.limit_memory(memory_mb)

  async def call(self, op: str, env_id: int, arg: Any) -> tuple[bool, Any]:
    try:
      return True, await self.host.call(op, env_id, arg)
    except asyncio.CancelledError:
      raise
    except BaseException as e:  # noqa: BLE001 -- everything the environment does goes back
      return False, encode_error(e)

  def ready(self) -> bool:
    return True


class ActorWorker(Worker):
  """The RL process's side of one `EnvActor`: each call is an actor task whose result the
  worker's answer path settles; an actor error marks the worker lost."""

  def __init__(
    self,
    index: int,
    name: str,
    kwargs: Mapping[str, Any],
    memory_mb: int,
    threads: int,
    resources: Mapping[str, float],
    start_timeout_s: float,
  ):
    super().__init__(f"environment actor {index}")
    resources = dict(resources)
    num_cpus = resources.pop("CPU", 1.0)
    self.actor = EnvActor.options(
      num_cpus=num_cpus, resources=resources, max_concurrency=max(1000, threads)
    ).remote(name, dict(kwargs), memory_mb, threads)
    self._env_name = name
    try:
      ray.get(self.actor.ready.remote(), timeout=start_timeout_s)
    except ray.exceptions.RayActorError as e:
      cause = str(e.__cause__ or e).strip().splitlines()[-1]
      raise EnvError(f"{self.name} could not start: {cause}") from None
    except ray.exceptions.GetTimeoutError:
      ray.kill(self.actor)
      raise TimeoutError(
        f"{self.name} did not start in {start_timeout_s:g} s: does the Ray cluster have a node "
        f"with the resources config.env.worker_resources asks for ({dict(resources)}, CPU "
        f"{num_cpus})? Start one, or change the setting."
      ) from None

  def _send(self, message: tuple) -> None:
    call_id, op, env_id, arg = message
    ref = self.actor.call.remote(op, env_id, arg)
    if call_id is None:
      return
    threading.Thread(target=self._wait, args=(call_id, ref), daemon=True).start()

  def _wait(self, call_id: int, ref) -> None:
    try:
      ok, value = ray.get(ref)
    except ray.exceptions.RayActorError as e:
      self._died(
        f"{self.name} died ({type(e).__name__}); the environments it held are lost (its node "
        "was lost, it crashed, or config.env.worker_memory_mb was too small)"
      )
      return
    except Exception as e:
      ok, value = False, encode_error(e)
    self._answer(call_id, ok, value, f"environment {self._env_name} (in {self.name})")

  def stop(self) -> None:
    with self._lock:
      self.lost = self.lost or f"{self.name} was stopped"
    try:
      ray.kill(self.actor)
    except Exception:
      log.debug("killing %s failed", self.name, exc_info=True)


def actor_workers(
  name: str,
  kwargs: Mapping[str, Any],
  *,
  count: int,
  memory_mb: int,
  threads: int,
  resources: Mapping[str, float],
  start_timeout_s: float = 120.0,
) -> EnvWorkers:
  """A pool of `count` Ray actors running environment `name` (Ray must be initialised)."""
  return EnvWorkers(
    lambda i: ActorWorker(i, name, kwargs, memory_mb, threads, resources, start_timeout_s),
    count,
    name,
  )
