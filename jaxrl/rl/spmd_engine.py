"""One paged engine run by several processes: a rollout instance whose mesh spans processes.

Every process of such an instance holds a `PagedEngine` over the same mesh, and every device
call must be made by all of them, in the same order, with the same host inputs (SPMD). The
engine's host side is deterministic: from the same sequence of calls (`submit`, `step`,
`drain`, `abort`, `update_weights`, `release_memory`) with the same arguments, and the same
values read back from the devices (which a mesh across processes replicates: `PagedCalls`),
each process makes the same device calls. So one process (rank 0) decides and the others
repeat:

- `MirroredEngine`, on rank 0, is the engine `workers.LocalWorker` drives: it sends every call
  that changes the engine to the other ranks before it makes it itself. Calls that only queue
  on the host (`submit`) go with the next call that runs on the devices, one message per
  decode window.
- `Follower`, on every other rank, applies those calls to its engine in sequence order, on a
  thread of its own. New weights come as a token (`update_weights`): each follower fetches the
  same version itself (from the weight store, on the Ray backend) and places its own shards.

How the calls travel is the backend's business (`send`, `fetch`). A rank that dies or waits
too long (`CallWatch`) is the backend's to find: the others would wait for it in their next
collective.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl.rl.workers import copy_record
from jaxrl.rollout.paged import PagedEngine
from jaxrl.rollout.requests import RequestRecord

log = logging.getLogger(__name__)

Command = tuple  # (name, *arguments): a call of the engine, as `MirroredEngine` sends it


class CallWatch:
  """When a process entered the engine call it is in (a stuck collective shows as a call that
  does not end)."""

  def __init__(self):
    self._since: float | None = None
    self._what = ""

  @contextlib.contextmanager
  def call(self, what: str):
    self._since, self._what = time.monotonic(), what
    try:
      yield
    finally:
      self._since = None

  def stuck(self, limit_s: float) -> str:
    """A message if the process has been in one call for more than `limit_s`, else ""."""
    since, what = self._since, self._what
    if since is None or time.monotonic() - since <= limit_s:
      return ""
    return (
      f"in the engine's {what} for {time.monotonic() - since:.0f} s (limit {limit_s:.0f} s): "
      "a process of the rollout instance waits in a collective for another that does not come"
    )


class MirroredEngine:
  """Rank 0's engine: `PagedEngine`'s calls, each sent to the other ranks before it is made
  here. `send(commands)` delivers a list of commands to every other rank (in order);
  `weights_token(version)` says how they get the weights of `version` (`Follower`'s `fetch`).
  Callers change the engine through these methods only."""

  def __init__(
    self,
    engine: PagedEngine,
    send: Callable[[list[Command]], None],
    weights_token: Callable[[int], Any],
  ):
    self.engine = engine
    self.watch = CallWatch()
    self._send = send
    self._weights_token = weights_token
    self._queued: list[Command] = []  # host-only calls, sent with the next device call

  # -- what the worker reads ---------------------------------------------------------------------

  @property
  def cfg(self):
    return self.engine.cfg

  @property
  def mesh(self):
    return self.engine.mesh

  @property
  def params(self):
    return self.engine.params

  @property
  def version(self) -> int:
    return self.engine.version

  @property
  def has_work(self) -> bool:
    return self.engine.has_work

  @property
  def running(self) -> dict:
    return self.engine.running

  @property
  def waiting(self):
    return self.engine.waiting

  # -- what changes it ---------------------------------------------------------------------------

  def submit(self, record: RequestRecord) -> str:
    rid = self.engine.submit(record)  # checked here first: a rejected request is not sent
    self._queued.append(("submit", copy_record(record)))
    return rid

  def step(self) -> list[RequestRecord]:
    return self._call(("step",), self.engine.step)

  def drain(self) -> list[RequestRecord]:
    return self._call(("drain",), self.engine.drain)

  def abort(self, request_ids: Sequence[str]) -> list[RequestRecord]:
    ids = list(request_ids)
    return self._call(("abort", ids), lambda: self.engine.abort(ids))

  def release_memory(self) -> None:
    self._call(("release_memory",), self.engine.release_memory)

  def stop_precompiling(self) -> None:
    # Host-only, this rank's: the worker that stops (any thread) ends with its gang's processes.
    self.engine.stop_precompiling()

  def drop_kept(self, request_id: str) -> bool:
    # Frees pages: every rank's allocator must do the same, or their page tables diverge.
    return self._call(("drop_kept", request_id), lambda: self.engine.drop_kept(request_id))

  def update_weights(self, params, version: int) -> None:
    token = self._weights_token(version)
    self._call(
      ("update_weights", token, version), lambda: self.engine.update_weights(params, version)
    )

  def _call(self, command: Command, run: Callable[[], Any]):
    """Sends the queued calls and `command` to the other ranks, then runs it here."""
    self._send([*self._queued, command])
    self._queued = []
    with self.watch.call(command[0]):
      return run()


class Follower:
  """A rank other than 0: applies rank 0's commands to its own engine, in sequence order, on
  a thread of its own. It queues commands from the start; `start` gives it its engine (rank 0
  may send its first calls while this rank still builds). `fetch(token)` returns the
  (version, params) a weights token names."""

  def __init__(self, fetch: Callable[[Any], tuple[int, Any]], name: str):
    self.engine: PagedEngine | None = None
    self.watch = CallWatch()
    self.error = ""  # what stopped it, if anything did
    self._fetch = fetch
    self._calls: dict[str, Callable] = {}
    self._pending: dict[int, list[Command]] = {}
    self._next = 0  # the next message to apply
    self.applied = 0  # messages applied so far
    self._ready = threading.Condition()
    self._thread = threading.Thread(target=self._run, name=f"follower-{name}", daemon=True)

  def start(self, engine: PagedEngine) -> None:
    self.engine = engine
    self._calls = {
      "submit": engine.submit,
      "step": engine.step,
      "drain": engine.drain,
      "abort": engine.abort,
      "release_memory": engine.release_memory,
      "drop_kept": engine.drop_kept,
      "update_weights": self._update_weights,
    }
    self._thread.start()

  @property
  def started(self) -> bool:
    return self.engine is not None

  def apply(self, seq: int, commands: list[Command]) -> None:
    """Queues rank 0's message number `seq` (messages may arrive out of order)."""
    with self._ready:
      self._pending[seq] = commands
      self._ready.notify()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def _update_weights(self, token, version: int) -> None:
    pulled = self._fetch(token)
    if pulled[0] != version:
      raise RuntimeError(f"Rank 0 took weights version {version}; this rank got {pulled[0]}.")
    self.engine.update_weights(pulled[1], version)

  def _run(self) -> None:
    try:
      while True:
        with self._ready:
          # Idle is fine: rank 0 may have nothing to decode. A lost rank 0 is found by the
          # backend, which then ends this process.
          self._ready.wait_for(lambda: self._next in self._pending)
          commands = self._pending.pop(self._next)
          self._next += 1
        for name, *args in commands:
          with self.watch.call(name):
            self._calls[name](*args)
        self.applied += 1
    except Exception as e:  # rank 0 met the same error, or this rank diverged: both fatal
      log.exception("A follower rank of a rollout instance failed.")
      self.error = f"{type(e).__name__}: {e}"
