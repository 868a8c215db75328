"""The environment interface: sync and async steps through one adapter, timeouts, type checks."""

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

from jaxrl.envs import (
  EnvError,
  Environment,
  Step,
  StepTimeout,
  check_messages,
  check_step,
  run_reset,
  run_step,
)


class SyncEcho(Environment):
  def __init__(self):
    self.thread = None

  def reset(self, record):
    return [{"role": "user", "content": record["q"]}]

  def step(self, action):
    self.thread = threading.get_ident()
    return Step([{"role": "user", "content": action.upper()}], 0.5, action == "stop")


class AsyncEcho(Environment):
  async def reset(self, record):
    await asyncio.sleep(0)
    return [{"role": "user", "content": record["q"]}]

  async def step(self, action):
    await asyncio.sleep(0.01)
    return Step([{"role": "user", "content": action[::-1]}], 1.0, True, {"tool_calls": 2})


def test_sync_step_runs_in_a_thread_and_async_step_is_awaited():
  sync, async_ = SyncEcho(), AsyncEcho()

  async def main():
    first = await run_reset(sync, {"q": "hi"}, 1.0)
    step = await run_step(sync, "go", 1.0)
    first_async = await run_reset(async_, {"q": "yo"}, 1.0)
    step_async = await run_step(async_, "abc", 1.0)
    return first, step, first_async, step_async

  first, step, first_async, step_async = asyncio.run(main())
  assert first == [{"role": "user", "content": "hi"}]
  assert step == Step([{"role": "user", "content": "GO"}], 0.5, False)
  assert sync.thread != threading.get_ident()  # a plain step never blocks the event loop
  assert first_async == [{"role": "user", "content": "yo"}]
  assert step_async.messages == [{"role": "user", "content": "cba"}] and step_async.done


def test_a_hung_sync_step_times_out_without_blocking_the_loop():
  release = threading.Event()

  class Hangs(SyncEcho):
    def step(self, action):
      release.wait(10)
      return Step()

  pool = concurrent.futures.ThreadPoolExecutor(2)

  async def main():
    ticks = 0

    async def tick():
      nonlocal ticks
      while True:
        await asyncio.sleep(0.01)
        ticks += 1

    ticker = asyncio.create_task(tick())
    with pytest.raises(StepTimeout, match=r"Hangs.step\(\) took longer than its timeout of 0.2 s"):
      await run_step(Hangs(), "x", 0.2, executor=pool)
    ticker.cancel()
    return ticks

  try:
    assert asyncio.run(main()) >= 5  # the loop kept running while the step hung
  finally:
    release.set()
    pool.shutdown(wait=True)


def test_an_async_step_past_its_timeout_is_cancelled():
  cancelled = []

  class Slow(AsyncEcho):
    async def step(self, action):
      try:
        await asyncio.sleep(30)
      except asyncio.CancelledError:
        cancelled.append(True)
        raise

  with pytest.raises(StepTimeout):
    asyncio.run(run_step(Slow(), "x", 0.05))
  assert cancelled == [True]


def test_a_timeout_error_of_the_environment_itself_is_not_a_step_timeout():
  class OwnTimeout(AsyncEcho):
    async def step(self, action):
      raise TimeoutError("the service did not answer")

  with pytest.raises(TimeoutError, match="did not answer") as info:
    asyncio.run(run_step(OwnTimeout(), "x", 5.0))
  assert not isinstance(info.value, StepTimeout)


def test_a_plain_method_that_returns_a_coroutine_is_awaited():
  class Wrapped(Environment):
    def reset(self, record):
      return []

    def step(self, action):
      async def later():
        return Step(reward=0.25)

      return later()

  assert asyncio.run(run_step(Wrapped(), "x", 1.0)).reward == 0.25


@pytest.mark.parametrize(
  "value, field",
  [
    ((["m"], 1.0, True, {}), "expected jaxrl.envs.Step"),
    (Step(reward="1"), r"Step.reward = '1' \(str\); expected a float"),
    (Step(reward=True), r"Step.reward = True \(bool\)"),
    (Step(reward=float("nan")), "finite"),
    (Step(done=1), r"Step.done = 1 \(int\); expected a bool"),
    (Step(messages="hi"), r"Step.messages = 'hi' \(str\); expected a list"),
    (Step(messages=[{"role": "user", "content": 3}]), r"Step.messages\[0\]\['content'\] = 3"),
    (Step(messages=[{"content": "x"}]), r"Step.messages\[0\]\['role'\] = None"),
    (Step(messages=[("user", "x")]), r"Step.messages\[0\] = \('user', 'x'\) \(tuple\)"),
    (Step(info=[]), r"Step.info = \[\] \(list\); expected a dict"),
    (Step(info={"tool_calls": -1}), r"Step.info\['tool_calls'\] = -1"),
    (Step(info={"tool_calls": 1.5}), r"Step.info\['tool_calls'\] = 1.5"),
    (Step(done=True, info={"end_reason": 3}), r"Step.info\['end_reason'\] = 3"),
  ],
)
def test_check_step_names_the_environment_and_the_field(value, field):
  with pytest.raises(EnvError, match=field) as info:
    check_step(value, "environment my_env: step() returned")
  assert str(info.value).startswith("environment my_env: step() returned")


def test_check_step_normalises_numpy_values_and_copies():
  messages = [{"role": "tool", "content": "4", "name": "python"}]
  step = check_step(Step(messages, np.float32(0.75), np.bool_(True), {"tool_calls": 1}), "w")
  assert type(step.reward) is float and step.reward == 0.75
  assert step.done is True
  assert step.messages == messages and step.messages[0] is not messages[0]


def test_check_messages_needs_a_first_message_at_reset():
  with pytest.raises(EnvError, match="is empty"):
    check_messages([], "environment e: reset() returned", allow_empty=False)
  assert check_messages((), "w", allow_empty=True) == []
  with pytest.raises(EnvError, match=r"\[0\]\['role'\] is empty"):
    check_messages([{"role": "", "content": "x"}], "w", allow_empty=True)
