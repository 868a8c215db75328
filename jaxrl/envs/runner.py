"""Where environment calls run: an asyncio loop on a thread of its own, and a thread pool for
environments' plain (not `async`) methods.

The rollout (`jaxrl.rl.multi_turn`) and the RL loop (`jaxrl.rl.episodes`) hand every `reset`
and `step` to an `EnvRunner` and go on decoding; a call's result comes back through a callback
on the runner's thread, which only hands it over (to a queue, a future), so that the caller's
state is touched by the caller's thread alone. Each call has its own timeout (`Episode`), and
`close` cancels the calls still pending (their futures end cancelled) without waiting for a
plain method that hangs: its thread is left to finish in the background, its result dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

# Seconds `close` gives pending calls to take their cancellation.
CANCEL_TIMEOUT_S = 5.0


class EnvRunner:
  """An event loop thread and a thread pool for environment calls.

  Args:
    threads: threads for plain methods (steps of many environments run at once).
    name: a prefix for the threads' names.
  """

  def __init__(self, threads: int = 16, name: str = "env"):
    if threads < 1:
      raise ValueError(f"EnvRunner needs at least one thread, got {threads}")
    self.executor = concurrent.futures.ThreadPoolExecutor(threads, f"{name}-call")
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
    self._thread.start()
    self._closed = False

  def submit(
    self, coroutine: Coroutine, on_done: Callable[[concurrent.futures.Future], Any] | None = None
  ) -> concurrent.futures.Future:
    """Runs `coroutine` on the loop; `on_done(future)` is called when it ends (on the loop's
    thread: keep it short). Returns the future of its result."""
    if self._closed:
      coroutine.close()
      raise RuntimeError("EnvRunner is closed")
    future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
    if on_done is not None:
      future.add_done_callback(on_done)
    return future

  def close(self) -> None:
    """Cancels the calls still pending, then stops the loop and the pool without waiting for
    plain methods still running (once)."""
    if self._closed:
      return
    self._closed = True
    if self._thread.is_alive():
      cancelled = asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop)
      # A call that ignores its cancellation past the timeout: the loop is stopped all the same.
      with contextlib.suppress(concurrent.futures.TimeoutError):
        cancelled.result(timeout=CANCEL_TIMEOUT_S)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=30)
    self.executor.shutdown(wait=False, cancel_futures=True)
    if not self._thread.is_alive():
      self._loop.close()

  def __enter__(self) -> EnvRunner:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


async def _cancel_pending() -> None:
  """Cancels every other task on the running loop and waits for them to end. A call
  submitted but not yet started then ends too (its coroutine closed, not left for the garbage
  collector to report as never awaited), and one awaiting a plain method's thread stops
  awaiting it, so the thread's late result is dropped quietly rather than posted to a closed
  loop."""
  tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
  for task in tasks:
    task.cancel()
  if tasks:
    await asyncio.wait(tasks, timeout=CANCEL_TIMEOUT_S)
