"""The asynchronous loop on the `ray` backend: rollout workers as Ray actors on a local Ray
cluster, killed without notice, preempted with notice and added during a run."""

import time

import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from jaxrl.rl import job  # noqa: E402
from jaxrl.rl.ray_backend import RayWeightStore, RayWorker, RemoteStore  # noqa: E402
from jaxrl.rl.weights import StoreUnreachable  # noqa: E402

from .async_test import Ledger, async_config  # noqa: E402, TID252


@pytest.fixture(scope="module")
def local_ray():
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  yield
  ray.shutdown()


def test_ray_workers_killed_preempted_and_added_lose_nothing(tmp_path, local_ray):
  cfg = async_config(
    **{
      "loop.backend": "ray",
      "loop.max_staleness": 1,
      "loop.rollout_workers": 2,
      "train.steps": 5,
      # Long enough responses (no end token) that the kill finds requests in flight.
      "rollout.sampling.max_new_tokens": 40,
      "rollout.sampling.ignore_eos": True,
      "rollout.paged.decode_steps": 1,
    }
  )
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  assert isinstance(controller.weights, RayWeightStore)
  assert all(isinstance(w, RayWorker) for w in controller.initial_workers)
  ledger = Ledger(1)
  ledger.attach(controller)
  done = set()

  def faults(c):
    if c.state.step >= 1 and "kill" not in done and c.assigned:
      done.add("kill")  # a worker holding requests dies without notice
      # The worker sent the latest request: the oldest ones may finish while it is killed.
      victim = list(c.assigned.values())[-1]
      c.add_worker(c.make_worker("w2"))
      c.kill_worker(victim)
    elif c.state.step >= 3 and "preempt" not in done:
      done.add("preempt")
      c.add_worker(c.make_worker("w3"))
      c.remove_worker(sorted(n for n in c.workers if n != "w3")[0])

  controller.hooks.append(faults)
  controller.run()
  ledger.check(controller, cfg)
  assert done == {"kill", "preempt"}
  assert controller.counters["workers_killed"] == 1
  assert controller.counters["requests_redispatched"] >= 1


def test_a_worker_cannot_reach_a_dead_store(local_ray):
  store = RayWeightStore()
  store.publish({"w": 1}, 0)
  remote = RemoteStore(store.actor, timeout_s=5.0)
  assert remote.pull(-1)[0] == 0
  assert remote.pull(0) is None
  ray.kill(store.actor, no_restart=True)  # asynchronous: wait until the actor is gone
  for _ in range(200):
    try:
      ray.get(store.actor.version.remote(), timeout=5)
    except ray.exceptions.RayError:
      break
    time.sleep(0.05)
  with pytest.raises(StoreUnreachable, match="weight store actor"):
    remote.pull(0)
