"""Rollout workers that crash: a crashed worker is restarted on its devices (up to
`config.loop.worker_restarts` times), and a loop left with no worker stops with a clear error
after `config.loop.no_worker_timeout_s` instead of waiting forever.

The sync loop runs one worker over all rollout devices: a single crash leaves it none.
"""

import logging
import threading
import time
import types

import pytest

from jaxrl.rl import job
from jaxrl.rl.worker_pool import RolloutWorkersLost, WorkerPool

from .job_test import tiny_config  # noqa: TID252


def sync_config(**overrides):
  base = {
    "warmup.steps": 0,
    "eval.every": 0,
    "loop.mode": "sync",
    "rollout.sampling.max_new_tokens": 8,
    "rollout.paged.decode_steps": 2,
    "rollout.paged.page_size": 32,
    "checkpoint.every": 0,
  }
  return tiny_config("test", **(base | overrides))


def crash_engine_steps(worker, *, after: int, times: float):
  """Makes `worker`'s engine raise at its `after`-th decode step, `times` times in a row."""
  engine = worker.engine
  step, calls = engine.step, iter(range(10**9))

  def failing_step():
    n = next(calls)
    if after <= n < after + times:
      raise RuntimeError("test: device lost")
    return step()

  engine.step = failing_step


def give_up_after(seconds: float):
  """A loop hook that fails the test instead of letting a loop that never ends hang CI."""
  start = time.monotonic()

  def check(controller):
    assert time.monotonic() - start < seconds, f"still at step {controller.state.step}"

  return check


def test_a_crashed_sync_worker_is_restarted_and_the_run_completes(tmp_path):
  cfg = sync_config(**{"train.steps": 2, "loop.worker_restarts": 1})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  (worker,) = controller.initial_workers
  crash_engine_steps(worker, after=1, times=1)
  controller.hooks.append(give_up_after(300))
  controller.run()
  assert controller.state.step == 2
  assert controller.counters["workers_crashed"] == 1
  assert controller.counters["workers_restarted"] == 1
  assert controller.counters["requests_redispatched"] > 0  # the crashed worker's requests


def test_a_worker_crashing_at_every_restart_uses_up_the_restarts_then_stops(tmp_path):
  cfg = sync_config(
    **{"train.steps": 2, "loop.worker_restarts": 2, "loop.no_worker_timeout_s": 0.5}
  )
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  backend_make = controller.backend.make_worker

  def make_crashing_worker(name, devices, store):
    worker = backend_make(name, devices, store)
    crash_engine_steps(worker, after=0, times=float("inf"))
    return worker

  controller.backend.make_worker = make_crashing_worker
  controller.initial_workers = controller.fresh_workers()
  controller.hooks.append(give_up_after(300))
  # The error names the last crash and the restarts used (not a hang: the loop had no worker).
  match = r"w\d+ crashed: RuntimeError\('test: device lost'\).*restarted 2 times"
  with pytest.raises(RolloutWorkersLost, match=match):
    controller.run()
  assert controller.counters["workers_crashed"] == 3
  assert controller.state.step == 0 and not controller.workers


class _SlowToStop:
  """A worker whose thread is still in an engine step for `seconds` after it is killed."""

  def __init__(self, seconds: float):
    self._thread = threading.Thread(target=time.sleep, args=(seconds,))
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def join(self, timeout=None):
    self._thread.join(timeout)


def test_a_worker_slow_to_stop_is_waited_for_and_logged_not_abandoned(caplog):
  """Stopping waits for a worker's engine step to end (it may hold its devices), and says so
  while it waits instead of hanging silently."""
  pool = types.SimpleNamespace(JOIN_WARN_S=0.05)
  worker = _SlowToStop(0.4)
  with caplog.at_level(logging.WARNING, logger="jaxrl.rl.worker_pool"):
    WorkerPool._join(pool, "w3", worker)
  assert not worker.alive
  waits = [r.getMessage() for r in caplog.records if "w3 was told to stop" in r.getMessage()]
  assert len(waits) >= 2, waits
  assert "still in an engine step" in waits[0]


def test_a_restarted_worker_takes_a_name_no_running_worker_has(tmp_path):
  """The pool names workers it adds `w<n>`, counting on from its initial workers; a caller may
  have added one under the next such name itself. A crash restart then took that name and the
  loop stopped on "already running" (seen in a Ray test that adds "w1"); it skips it now."""
  cfg = sync_config(**{"train.steps": 2, "loop.worker_restarts": 1})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  (worker,) = controller.initial_workers  # w0: the pool's next name is w1
  crash_engine_steps(worker, after=1, times=1)
  added = []

  def add_a_worker_named_w1(c):
    if not added:
      added.append(c.make_worker("w1", c.slot_of["w0"]))  # beside w0, on its devices
      c.add_worker(added[0])

  controller.hooks += [add_a_worker_named_w1, give_up_after(300)]
  controller.run()
  assert controller.state.step == 2
  assert controller.counters["workers_crashed"] == 1
  assert controller.counters["workers_restarted"] == 1
  assert added
