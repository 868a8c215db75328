"""Environments that run in worker processes: `RemoteEnv` stands in for one in the RL process.

A tool or environment that crashes, leaks memory or holds the GIL should not take the learner
or the engine with it. With `config.env.run_in="processes"` every environment lives in one of
`config.env.workers` worker processes (spawned, so they share nothing with the JAX process);
with "ray", in Ray actors (`jaxrl.envs.ray_envs`). The RL process holds a `RemoteEnv` per
trajectory: its `reset` and `step` are coroutines that send the call to the worker and await
the answer, so the episode machinery (`Episode`: timeouts, checks, end reasons) is the same
for every placement.

In a worker an `EnvHost` holds the environments by id and runs their calls concurrently (an
asyncio loop, and a thread pool for plain methods), so one slow step does not hold up the other
trajectories of that worker. The worker limits its own address space
(`config.env.worker_memory_mb`, beyond what it holds when it starts): an environment that goes
past it gets a MemoryError in its step, and its episode ends "env_error".

A worker that dies (a crash, the OOM killer, a signal) loses the environments it held: every
call on them, pending or later, raises `EnvError` naming the worker and its exit status, so
their episodes end "env_error" with the trajectories kept, and the next environments go to a
fresh worker started in its place.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import resource
import signal
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.envs.base import EndEpisode, EnvError, Environment, Step, run_reset, run_step

log = logging.getLogger(__name__)


class EnvHost:
  """The environments of one worker, by id, and the calls on them (runs in the worker).

  Args:
    make_env: makes a fresh environment (`env_factory`).
    threads: threads for environments' plain (not `async`) methods.
  """

  def __init__(self, make_env: Callable[[], Environment], threads: int):
    self.make_env = make_env
    self.threads = threads
    self.executor = concurrent.futures.ThreadPoolExecutor(threads, "env-call")
    self.envs: dict[int, Environment] = {}
    self._tasks: dict[int, set[asyncio.Task]] = {}

  def limit_memory(self, memory_mb: int) -> None:
    """Caps the process's memory (`limit_memory`) after starting every thread of the pool, so
    that the cap bounds what environments allocate, not the threads' stacks and arenas (with
    the threads started under it, concurrent steps failed with "can't start new thread")."""
    barrier = threading.Barrier(self.threads)
    concurrent.futures.wait([self.executor.submit(barrier.wait, 30) for _ in range(self.threads)])
    limit_memory(memory_mb)

  async def call(self, op: str, env_id: int, arg: Any) -> Any:
    """Runs one call: "reset" (makes the environment; returns its first messages and its tool
    schemas), "step" (returns the `Step`) or "close". Raises what the environment raised."""
    if op == "close":
      self.close_env(env_id)
      return None
    task = asyncio.current_task()
    self._tasks.setdefault(env_id, set()).add(task)
    try:
      if op == "reset":
        env = self.envs[env_id] = self.make_env()
        messages = await run_reset(env, arg, None, executor=self.executor)
        return messages, [dict(t) for t in env.tools]
      if op == "step":
        if env_id not in self.envs:
          raise EnvError(f"environment {env_id} was closed or never reset")
        return await run_step(self.envs[env_id], arg, None, executor=self.executor)
      raise ValueError(f"unknown environment call {op!r}")
    finally:
      self._tasks.get(env_id, set()).discard(task)

  def close_env(self, env_id: int) -> None:
    """Closes an environment and cancels its calls still running (a step its episode gave up
    on: timed out). A plain method's thread cannot be stopped; its result is dropped."""
    for task in self._tasks.pop(env_id, ()):
      task.cancel()
    env = self.envs.pop(env_id, None)
    if env is not None:
      try:
        env.close()
      except Exception:
        log.exception("closing environment %d failed", env_id)


def encode_error(e: BaseException) -> tuple:
  """An exception as plain data (what crosses the process boundary; `decode_error` undoes it)."""
  if isinstance(e, EndEpisode):
    return ("EndEpisode", e.reason, e.message)
  tb = "".join(traceback.format_exception(e, limit=-3))
  return (type(e).__name__, str(e), tb)


def decode_error(data: tuple, where: str) -> Exception:
  """The exception to raise in the RL process for `encode_error`'s data: `EndEpisode` as
  itself (its reason is the episode's end reason), anything else as an `EnvError`."""
  if data[0] == "EndEpisode":
    return EndEpisode(data[1], data[2])
  name, message, tb = data
  return EnvError(f"{where} raised {name}: {message}\n{tb}")


def limit_memory(memory_mb: int) -> None:
  """Caps this process's address space at what it has now plus `memory_mb` (0: no cap), so that
  an environment's allocation past it raises MemoryError instead of exhausting the machine."""
  if memory_mb <= 0:
    return
  with open("/proc/self/statm") as f:
    now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  limit = now + memory_mb * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class RemoteEnv(Environment):
  """An environment that lives in a worker: `reset` and `step` are forwarded there.

  `tools` is filled in from the worker at `reset` (an environment may set its tools in its
  constructor or from the record).
  """

  def __init__(self, worker: Worker, env_id: int, name: str):
    self._worker = worker
    self._id = env_id
    self.tools = ()
    self.name_in_messages = f"{name} (in {worker.name})"

  async def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
    messages, tools = await self._worker.call("reset", self._id, record)
    self.tools = tools
    return messages

  async def step(self, action: str) -> Step:
    return await self._worker.call("step", self._id, action)

  def close(self) -> None:
    self._worker.close_env(self._id)


class Worker(abc.ABC):
  """The RL process's side of one environment worker (a process here, an actor in
  `ray_envs`): sends calls, matches answers, and turns the worker's death into `EnvError`s.

  Subclasses define `_send(message)` and start the reader that calls `_answer`/`_died`.
  """

  def __init__(self, name: str):
    self.name = name
    self.lost: str | None = None  # why the worker is gone, once it is
    self.num_envs = 0  # environments it holds
    self._lock = threading.Lock()
    self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
    self._ids = itertools.count()

  async def call(self, op: str, env_id: int, arg: Any) -> Any:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    with self._lock:
      if self.lost:
        raise EnvError(self.lost)
      call_id = next(self._ids)
      self._pending[call_id] = (loop, future)
    try:
      self._send((call_id, op, env_id, arg))
    except Exception as e:
      with self._lock:
        self._pending.pop(call_id, None)
      if self.lost:
        raise EnvError(self.lost) from None
      raise EnvError(f"{op}() could not be sent to {self.name}: {type(e).__name__}: {e}") from e
    try:
      return await future
    finally:
      with self._lock:
        self._pending.pop(call_id, None)

  def hold(self) -> None:
    """Counts one more environment on this worker."""
    with self._lock:
      self.num_envs += 1

  def close_env(self, env_id: int) -> None:
    with self._lock:
      self.num_envs -= 1
      if self.lost:
        return
    try:
      self._send((None, "close", env_id, None))
    except Exception:  # the worker is going; its environments go with it
      log.debug("close of environment %d not sent to %s", env_id, self.name, exc_info=True)

  def _answer(self, call_id: int, ok: bool, value: Any, where: str) -> None:
    with self._lock:
      entry = self._pending.get(call_id)
    if entry is None:  # its caller gave up (timed out)
      return
    loop, future = entry
    result = value if ok else decode_error(value, where)
    loop.call_soon_threadsafe(_settle, future, ok, result)

  def _died(self, why: str) -> None:
    with self._lock:
      stopped = self.lost is not None  # `stop` came first: no news
      self.lost = self.lost or why
      pending, self._pending = list(self._pending.values()), {}
    if not stopped:
      log.warning("%s", why)
    for loop, future in pending:
      loop.call_soon_threadsafe(_settle, future, False, EnvError(self.lost))

  @abc.abstractmethod
  def _send(self, message: tuple) -> None:
    """Sends `(call_id, op, env_id, arg)` to the worker (call_id None: no answer wanted)."""

  @abc.abstractmethod
  def stop(self) -> None:
    """Stops the worker; its environments are gone."""


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
  if future.done():  # cancelled by a timeout meanwhile
    return
  if ok:
    future.set_result(value)
  else:
    future.set_exception(value)


class ProcessWorker(Worker):
  """An environment worker process (spawned; `_serve` is its main)."""

  def __init__(
    self, index: int, name: str, kwargs: Mapping[str, Any], memory_mb: int, threads: int
  ):
    super().__init__(f"environment worker process {index}")
    context = multiprocessing.get_context("spawn")
    self._conn, child = context.Pipe()
    self._send_lock = threading.Lock()
    self.process = context.Process(
      target=_serve,
      args=(child, name, dict(kwargs), memory_mb, threads),
      name=f"jaxrl-env-{index}",
      daemon=True,
    )
    self.process.start()
    child.close()
    self.name = f"environment worker process {index} (pid {self.process.pid})"
    self._env_name = name
    self._reader = threading.Thread(target=self._read, name=f"env-worker-{index}", daemon=True)
    self._reader.start()

  def _send(self, message: tuple) -> None:
    with self._send_lock:
      self._conn.send(message)

  def _read(self) -> None:
    answered = False
    while True:
      try:
        call_id, ok, value = self._conn.recv()
      except (EOFError, OSError):
        break
      answered = True
      self._answer(call_id, ok, value, f"environment {self._env_name} (in {self.name})")
    self.process.join(timeout=5)
    code = self.process.exitcode
    if code is not None and code < 0:
      status = f"killed by {signal.Signals(-code).name}"
    else:
      status = f"exit code {code}"
    hint = ""
    if not answered and code == 1:
      hint = (
        "; a worker that dies before its first answer: does the script that started the run "
        "lack an `if __name__ == '__main__':` guard (spawned processes import it again)?"
      )
    self._died(
      f"{self.name} died ({status}); the environments it held are lost (a crash, the OOM "
      f"killer, or config.env.worker_memory_mb too small for a C extension's allocation){hint}"
    )

  def stop(self) -> None:
    with self._lock:
      self.lost = self.lost or f"{self.name} was stopped"
    try:
      with self._send_lock:
        self._conn.send(None)
    except Exception:
      pass
    self.process.join(timeout=5)
    if self.process.is_alive():
      self.process.kill()
      self.process.join(timeout=5)
    self._conn.close()


def _serve(conn, name: str, kwargs: dict, memory_mb: int, threads: int) -> None:
  """A worker process's main: reads calls from `conn`, runs them on an `EnvHost`, answers."""
  from jaxrl.envs.registry import env_factory

  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the RL process decides when a worker stops
  host = EnvHost(env_factory(name, kwargs), threads)
  host.limit_memory(memory_mb)
  loop = asyncio.new_event_loop()
  threading.Thread(target=loop.run_forever, name="env-loop", daemon=True).start()

  async def handle(call_id: int | None, op: str, env_id: int, arg: Any) -> None:
    try:
      value, ok = await host.call(op, env_id, arg), True
    except asyncio.CancelledError:
      return
    except BaseException as e:  # noqa: BLE001 -- everything the environment does goes back
      value, ok = encode_error(e), False
    if call_id is None:
      return
    try:
      conn.send((call_id, ok, value))
    except Exception as e:  # an answer that does not pickle
      conn.send((call_id, False, ("PicklingError", f"its answer does not pickle: {e}", "")))

  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      break
    if message is None:
      break
    asyncio.run_coroutine_threadsafe(handle(*message), loop)

  async def close_all() -> None:
    for env_id in list(host.envs):
      host.close_env(env_id)

  try:
    asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=30)
  finally:
    os._exit(0)  # threads stuck in a hung plain step must not keep the process alive


class EnvWorkers:
  """The pool of environment workers of one run: makes `RemoteEnv`s spread over the workers
  (the one holding fewest first) and replaces a worker that died.

  Args:
    start_worker: starts worker `index`.
    count: workers.
    name: the environment's name, for messages.
  """

  def __init__(self, start_worker: Callable[[int], Worker], count: int, name: str):
    self._start_worker = start_worker
    self._name = name
    self._lock = threading.Lock()
    self._workers = [start_worker(i) for i in range(count)]
    self._env_ids = itertools.count()
    self.replaced = 0  # workers started in place of one that died

  def make_env(self) -> RemoteEnv:
    with self._lock:
      for i, worker in enumerate(self._workers):
        if worker.lost:
          log.warning("starting a new environment worker in place of: %s", worker.lost)
          try:
            self._workers[i] = self._start_worker(i)
          except Exception as e:  # the others go on; it is tried again for the next one
            log.warning("environment worker %d did not start again: %s", i, e)
            continue
          self.replaced += 1
      live = [w for w in self._workers if not w.lost]
      if not live:
        raise EnvError(
          f"every environment worker of {self._name} is lost and none could be started "
          f"again; the last: {self._workers[-1].lost if self._workers else 'closed'}"
        )
      worker = min(live, key=lambda w: w.num_envs)
      worker.hold()
    return RemoteEnv(worker, next(self._env_ids), self._name)

  def close(self) -> None:
    with self._lock:
      workers, self._workers = self._workers, []
    for worker in workers:
      worker.stop()


def process_workers(
  name: str, kwargs: Mapping[str, Any], *, count: int, memory_mb: int, threads: int
) -> EnvWorkers:
  """A pool of `count` worker processes running environment `name` with `kwargs`."""
  return EnvWorkers(lambda i: ProcessWorker(i, name, kwargs, memory_mb, threads), count, name)
