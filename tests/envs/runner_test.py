"""`EnvRunner.close` with calls still pending: they end cancelled, at once, and nothing is
reported after (no coroutine never awaited, no result posted to a closed loop)."""

import asyncio
import concurrent.futures
import inspect
import sys
import threading
import time

import pytest

from jaxrl.envs.runner import EnvRunner


def test_close_cancels_pending_calls_and_drops_late_results_quietly(monkeypatch):
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  runner = EnvRunner(threads=2)
  plain_started, plain_done = threading.Event(), threading.Event()

  def plain_method():  # an environment's plain step, still running when the runner closes
    plain_started.set()
    time.sleep(0.5)
    plain_done.set()

  async def in_thread():
    await asyncio.get_running_loop().run_in_executor(runner.executor, plain_method)

  waiting = asyncio.sleep(60)
  calls = [runner.submit(in_thread()), runner.submit(waiting)]
  assert plain_started.wait(10)
  last = asyncio.sleep(60)
  calls.append(runner.submit(last))  # submitted just before the close
  start = time.monotonic()
  runner.close()
  assert time.monotonic() - start < 5  # the plain method is not waited for
  for call in calls:
    with pytest.raises(concurrent.futures.CancelledError):
      call.result(timeout=1)
  assert inspect.getcoroutinestate(waiting) == inspect.CORO_CLOSED
  assert inspect.getcoroutinestate(last) == inspect.CORO_CLOSED
  assert plain_done.wait(10)
  time.sleep(0.2)  # the thread's result is handed back after it ends
  assert unraisable == []
  with pytest.raises(RuntimeError, match="closed"):
    runner.submit(asyncio.sleep(0))
