"""Environments in worker processes (`config.env.run_in="processes"`): episodes play as they do
in this process; a step past the memory cap, a hung step, a raised `EndEpisode` and a worker that
dies end their own episodes only, with the recorded reason; a dead worker is replaced."""

import asyncio
import dataclasses
import os

import pytest

from jaxrl.envs import EnvError, Episode, EpisodeLimits
from jaxrl.envs.registry import EnvConfig, env_factory

MISBEHAVING = "helpers.worker_envs:Misbehaving"
LIMITS = EpisodeLimits(max_turns=8, step_timeout_s=20.0)


def start(name=MISBEHAVING, **kwargs):
  return EnvConfig(name=name, run_in="processes", threads=4, **kwargs).start_workers()


@pytest.fixture(scope="module")
def workers():
  pool = start(workers=2, worker_memory_mb=256)
  yield pool
  pool.close()


def play(episode, actions, record_id="r"):
  async def go():
    await episode.reset({"id": record_id})
    steps = []
    for action in actions:
      steps.append(await episode.step(action))
    return steps

  return asyncio.run(go())


def test_episodes_in_worker_processes_play_as_in_this_process(workers):
  remote = Episode(workers.make_env(), LIMITS)
  local = Episode(env_factory(MISBEHAVING)(), LIMITS)
  assert play(remote, ["a", "b", "done"]) == play(local, ["a", "b", "done"])
  assert remote.summary() == local.summary()
  assert remote.messages == local.messages
  assert remote.summary().end_reason == "done" and remote.summary().rewards == (1.0, 1.0, 1.0)
  assert "worker process" in remote.name and MISBEHAVING in remote.name
  # Environments are spread over the workers, none in this process.
  pids = set()
  for i in range(2):
    step = play(Episode(workers.make_env(), LIMITS), ["pid"], f"p{i}")[0]
    pids.add(int(step.messages[0]["content"]))
  assert len(pids) == 2 and os.getpid() not in pids


def test_a_step_past_the_memory_cap_ends_its_episode_only(workers):
  greedy, modest = Episode(workers.make_env(), LIMITS), Episode(workers.make_env(), LIMITS)
  play(modest, [])
  [failed] = play(greedy, ["alloc 1024"])  # 1 GiB against a 256 MiB cap
  assert failed.done and failed.info["end_reason"] == "env_error"
  assert "MemoryError" in failed.info["error"]
  ok = asyncio.run(modest.step("alloc 16"))
  assert not ok.done and ok.messages[0]["content"] == "allocated 16 MiB"
  # The greedy environment's worker goes on serving.
  again = Episode(workers.make_env(), LIMITS)
  assert play(again, ["a", "done"])[-1].info["end_reason"] == "done"


def test_a_hung_step_times_out_and_its_worker_goes_on(workers):
  hung, other = Episode(workers.make_env(), LIMITS), Episode(workers.make_env(), LIMITS)
  play(other, [])
  play(hung, [])
  # Only the hanging step gets a short limit: a healthy call on a loaded 2-core machine can
  # take over a second (a reset under a 1 s limit timed out once in a full run on the 2-core VM).
  hung.limits = dataclasses.replace(LIMITS, step_timeout_s=1.0)
  step = asyncio.run(hung.step("hang"))
  assert step.info["end_reason"] == "step_timeout" and hung.summary().turns == 1
  assert asyncio.run(other.step("done")).info["end_reason"] == "done"


def test_end_episode_raised_in_a_worker_keeps_its_reason(workers):
  episode = Episode(workers.make_env(), LIMITS)
  [step] = play(episode, ["end"])
  assert step.info == {"end_reason": "tool_refused", "error": "the tool said no"}


def test_a_worker_that_dies_ends_the_episodes_it_held_and_is_replaced():
  pool = start(workers=2)
  try:
    first, second, third = (Episode(pool.make_env(), LIMITS) for _ in range(3))
    for i, episode in enumerate((first, second, third)):
      play(episode, [], f"r{i}")  # first and third share worker 0, second has worker 1
    [crashed] = play_more(first, "crash")
    assert crashed.info["end_reason"] == "env_error"
    assert "died (killed by SIGKILL)" in crashed.info["error"]
    [lost] = play_more(third, "a")  # held by the same worker: lost with it, trajectory kept
    assert lost.info["end_reason"] == "env_error" and "died" in lost.info["error"]
    [fine] = play_more(second, "done")
    assert fine.info["end_reason"] == "done" and fine.reward == 1.0
    assert pool.replaced == 0
    fresh = Episode(pool.make_env(), LIMITS)  # goes to a new worker 0
    assert pool.replaced == 1
    assert play(fresh, ["a", "done"])[-1].info["end_reason"] == "done"
  finally:
    pool.close()


def play_more(episode, action):
  return [asyncio.run(episode.step(action))]


def test_an_environment_that_fails_in_its_worker_is_a_clear_error():
  pool = start("helpers.worker_envs:FailsToStart", workers=1)
  try:
    with pytest.raises(EnvError, match="record 'r'.*RuntimeError: no licence for this simulator"):
      play(Episode(pool.make_env(), LIMITS), [])
  finally:
    pool.close()


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"run_in": "docker"}, "env.run_in='docker'"),
    ({"workers": 0}, "env.workers=0"),
    ({"worker_memory_mb": -1}, "env.worker_memory_mb=-1"),
  ],
)
def test_bad_worker_settings_are_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    EnvConfig(name=MISBEHAVING, **kwargs)


_HOST_UNDER_A_CAP = """
import concurrent.futures, sys, threading
from jaxrl.envs import GuessNumberEnv
from jaxrl.envs.remote import EnvHost
host = EnvHost(GuessNumberEnv, threads=16)
host.limit_memory(256)
gate = threading.Barrier(16)  # every thread busy at once, as 16 concurrent plain steps are
futures = [host.executor.submit(gate.wait, 30) for _ in range(16)]
concurrent.futures.wait(futures)
print(sum(f.exception() is None for f in futures))
"""


def test_a_capped_host_runs_every_thread_of_its_pool():
  """The cap comes after the pool's threads start (`EnvHost.limit_memory`); threads started
  under it failed with "can't start new thread" (a Ray environment actor did that)."""
  import subprocess
  import sys

  out = subprocess.run(
    [sys.executable, "-c", _HOST_UNDER_A_CAP], capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-1] == "16"
