"""Environments as Ray actors (`config.env.run_in="ray"`): episodes play as in this process, an
actor that dies ends the episodes it held with the trajectory kept and is replaced, and an
actor the cluster has no room for is a clear error within its timeout."""

import asyncio
import os
import time

import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from jaxrl.envs import EnvError, Episode, EpisodeLimits  # noqa: E402
from jaxrl.envs.ray_envs import actor_workers  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")

LIMITS = EpisodeLimits(max_turns=8, step_timeout_s=30.0)
MISBEHAVING = "helpers.worker_envs:Misbehaving"


@pytest.fixture(scope="module")
def local_ray():
  # The actors import the test environments from the tests' helpers, as a user's own class
  # must be importable on the cluster's nodes (an installed package, or the runtime env).
  tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  runtime_env = {"env_vars": {"PYTHONPATH": tests}}
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
  yield
  ray.shutdown()


def step(episode, action):
  return asyncio.run(episode.step(action))


def kill_and_wait(actor, timeout_s=30.0):
  """`ray.kill` only asks: a call sent right after it can still be served. Waits until the
  actor answers no more."""
  ray.kill(actor)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      ray.get(actor.__ray_ready__.remote(), timeout=5)
    except ray.exceptions.RayActorError:
      return
    time.sleep(0.1)
  raise AssertionError(f"the actor still answers {timeout_s} s after ray.kill")


def test_episodes_in_ray_actors_end_with_their_actor_and_the_actor_is_replaced(local_ray):
  pool = actor_workers(MISBEHAVING, {}, count=1, memory_mb=256, threads=2, resources={})
  try:
    first, second = Episode(pool.make_env(), LIMITS), Episode(pool.make_env(), LIMITS)
    for i, episode in enumerate((first, second)):
      assert asyncio.run(episode.reset({"id": f"r{i}"})) == [
        {"role": "user", "content": f"episode r{i}"}
      ]
    assert step(first, "a").reward == 1.0 and "environment actor 0" in first.name
    big = step(first, "alloc 1024")
    assert big.info["end_reason"] == "env_error" and "MemoryError" in big.info["error"]
    kill_and_wait(pool._workers[0].actor)
    lost = step(second, "a")
    assert lost.info["end_reason"] == "env_error" and "died" in lost.info["error"]
    assert second.summary().turns == 1
    fresh = Episode(pool.make_env(), LIMITS)
    assert pool.replaced == 1
    asyncio.run(fresh.reset({"id": "r2"}))
    assert step(fresh, "done").info["end_reason"] == "done"
  finally:
    pool.close()


def test_an_environment_that_fails_in_its_actor_is_a_clear_error(local_ray):
  with pytest.raises(EnvError, match="actor 0 could not start.*no module named 'no_such_pkg'"):
    actor_workers("no_such_pkg:Env", {}, count=1, memory_mb=0, threads=2, resources={})


def test_an_actor_the_cluster_cannot_place_is_a_clear_error(local_ray):
  with pytest.raises(TimeoutError, match="jaxrl-pool-cpu"):
    actor_workers(
      MISBEHAVING,
      {},
      count=1,
      memory_mb=0,
      threads=2,
      resources={"jaxrl-pool-cpu": 1},
      start_timeout_s=3,
    )
