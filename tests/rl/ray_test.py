"""The asynchronous loop on the `ray` backend: rollout workers as Ray actors on a local Ray
cluster, killed without notice, preempted with notice and added during a run; the learner as a
Ray actor that trains as the local learner does, warms up and checkpoints."""

import math
import os
import time

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from jaxrl.config import ConfigError  # noqa: E402
from jaxrl.model import Model  # noqa: E402
from jaxrl.rl import job  # noqa: E402
from jaxrl.rl.backends import LearnerLost, LocalBackend  # noqa: E402
from jaxrl.rl.checkpoint import Checkpointer  # noqa: E402
from jaxrl.rl.placement import place_stages  # noqa: E402
from jaxrl.rl.policy import make_tokenizer, model_config, rollout_model_config  # noqa: E402
from jaxrl.rl.ray_backend import RayBackend, RayWeightStore  # noqa: E402
from jaxrl.rl.ray_learner import RayLearner  # noqa: E402
from jaxrl.rl.ray_rollout import RayWorker, RemoteStore  # noqa: E402
from jaxrl.rl.stages import JobParts, make_learner  # noqa: E402
from jaxrl.rl.timeline import LEARNER_LANE, StageTimeline  # noqa: E402
from jaxrl.rl.weights import StoreUnreachable, WeightStore  # noqa: E402
from jaxrl.sharding import make_mesh  # noqa: E402
from jaxrl.train.learner import TrainBatch  # noqa: E402

from .async_test import Ledger, async_config  # noqa: E402, TID252
from .job_test import tiny_config  # noqa: E402, TID252

pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def local_ray():
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  yield
  ray.shutdown()


# `slow` (3 minutes on 2 cores): the same churn as async_test's local-worker test, which runs
# by default, through Ray actors.
@pytest.mark.slow
def test_ray_workers_killed_preempted_and_added_lose_nothing(tmp_path, local_ray):
  cfg = async_config(
    **{
      "loop.backend": "ray",
      "loop.max_staleness": 1,
      "loop.rollout_workers": 2,
      "train.steps": 6,
      # Long enough responses (no end token) that the kill finds requests in flight.
      "rollout.sampling.max_new_tokens": 40,
      "rollout.sampling.ignore_eos": True,
      "rollout.paged.decode_steps": 1,
    }
  )
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  assert isinstance(controller.weights, RayWeightStore)
  assert all(isinstance(w, RayWorker) for w in controller.initial_workers)
  assert isinstance(controller.learner, RayLearner)
  ledger = Ledger(1)
  ledger.attach(controller)
  done = set()

  def faults(c):
    if c.state.step >= 1 and "add" not in done:
      done.add("add")
      c.add_worker(c.make_worker("w2"))
    elif "add" in done and "kill" not in done and "w2" in c.assigned.values():
      # w2 dies without notice while it holds requests. A fresh actor starts and compiles for
      # seconds, so they cannot all have finished first (a running worker's could).
      done.add("kill")
      c.kill_worker("w2")
    elif c.state.step >= 3 and "kill" in done and "preempt" not in done:
      done.add("preempt")
      c.add_worker(c.make_worker("w3"))
      c.remove_worker(sorted(n for n in c.workers if n != "w3")[0])

  controller.hooks.append(faults)
  controller.run()
  ledger.check(controller, cfg)
  assert done == {"add", "kill", "preempt"}
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


@ray.remote
class _Process:
  def ping(self) -> bool:
    return True


class _FakeLearner:
  """The part of `RayLearner` the backend's watch reads: its processes' actors, and `kill`."""

  def __init__(self, processes: int):
    self.actors = [_Process.remote() for _ in range(processes)]
    self.killed = False

  def kill(self) -> None:
    self.killed = True
    for actor in self.actors:
      ray.kill(actor, no_restart=True)


def _raises_lost_within(backend, learner, store, seconds: float) -> str:
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    try:
      backend.raise_if_lost(learner, store)
    except LearnerLost as e:
      return str(e)
    time.sleep(0.05)
  raise AssertionError(f"nothing found lost in {seconds} s")


@pytest.mark.parametrize("lost", ["learner process 1", "weight store actor"])
def test_a_lost_learner_process_or_store_is_found_while_the_loop_waits(local_ray, lost):
  """The loop asks the backend at every turn while it waits for rollouts: a learner process or
  the store gone raises `LearnerLost` (the job goes on from its checkpoint) within seconds,
  without a call to the learner, and what is left of both is stopped. Before, a loop whose
  workers waited for a version the lost learner never published waited forever."""
  cfg = tiny_config("test", **{"loop.mode": "async", "loop.rollout_workers": 1})
  tokenizer = make_tokenizer(cfg)
  rollout_model = Model(rollout_model_config(cfg, model_config(cfg, tokenizer)))
  backend = RayBackend(JobParts(cfg, place_stages(cfg, 16), rollout_model, tokenizer, 16))
  backend.LIVENESS_CHECK_S = 0.0  # every call pings
  learner, store = _FakeLearner(2), RayWeightStore()
  for _ in range(5):  # all there: pinged and answered, nothing raised
    backend.raise_if_lost(learner, store)
    time.sleep(0.05)
  assert not learner.killed
  victim = learner.actors[1] if lost.startswith("learner") else store.actor
  ray.kill(victim, no_restart=True)
  why = _raises_lost_within(backend, learner, store, seconds=30)
  assert lost in why, why
  assert learner.killed
  with pytest.raises(ray.exceptions.RayActorError):
    ray.get(store.actor.version.remote(), timeout=30)


def _as_f32(tree, rounded_to=None):
  """Host float32 copies of `tree`'s leaves, first rounded to `rounded_to` if given."""
  return jax.tree.map(
    lambda x: np.asarray(x).astype(rounded_to or x.dtype).astype(np.float32), tree
  )


def _close(a, b, atol):
  leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return all(np.allclose(np.asarray(x), np.asarray(y), atol=atol) for x, y in leaves)


# Two processes of one device each by default (148 s of a full run: the default suite's only
# learner of several processes); of four devices each (an 8-device mesh) `slow`: gloo
# collectives between two processes sharing two loaded cores take minutes there.
@pytest.mark.parametrize(
  "shape, updates",
  [
    pytest.param({"fsdp": 2}, 2, id="2x1"),
    pytest.param({"fsdp": 4, "tensor": 2}, 5, id="2x4", marks=pytest.mark.slow),
    # Data parallel over the processes (what the planner picks for a small dense model): each
    # process holds a whole replica, and only rank 0's is published.
    pytest.param({"data": 2}, 2, id="data2", marks=pytest.mark.slow),
  ],
)
def test_a_learner_gang_of_two_processes_trains_as_the_local_learner_and_checkpoints(
  tmp_path, local_ray, shape, updates
):
  """Two Ray actors joined into one JAX world: the training mesh spans the processes, and the
  gang trains (`updates` updates, to 1e-5), publishes, restores and warms up as one local
  learner on the same mesh does; a process lost makes the next call raise `LearnerLost`.
  With decoupled PPO's proximal policy recomputed, which each process reads whole (it read
  its own rows' part only, and failed: found by the job fuzz's Ray draws)."""
  cfg = async_config(
    **{"loop.backend": "ray", "train.micro_batch_size": 8, "train.loss.proximal": "recompute"}
  )
  cores = sorted(os.sched_getaffinity(0))[-2:]  # the last two (`loop.ray_pin_cores`'s way)
  # A stuck gang fails the test in minutes, not after the default hour.
  remote = RayLearner(cfg, shape, num_processes=2, cores=cores, timeout_s=600)
  assert remote.cores() == cores  # pinned
  # The job's model (the tokenizer's vocabulary masks the embedding's spare rows), as the
  # actor builds it.
  model = Model(model_config(cfg, make_tokenizer(cfg)))
  local = make_learner(cfg, model, make_mesh(jax.devices()[: math.prod(shape.values())], shape))
  assert _close(remote.params, local.params, 0)  # same seed, same initial weights
  rng = np.random.default_rng(0)
  b, t = cfg.rollout.prompts_per_step * cfg.rollout.group_size, 12
  mask = (rng.random((b, t - 1)) < 0.7).astype(np.float32)
  batch = TrainBatch(
    tokens_bt=rng.integers(3, make_tokenizer(cfg).vocab_size, (b, t)).astype(np.int32),
    mask_bt=mask,
    old_logp_bt=np.log(rng.uniform(0.05, 0.9, (b, t - 1))).astype(np.float32) * mask,
    advantages_b=rng.normal(size=b).astype(np.float32),
  )
  for _ in range(updates):  # the losses and the state stay the local learner's
    remote_metrics, local_metrics = remote.update(batch), jax.device_get(local.update(batch))
    assert remote_metrics.keys() == local_metrics.keys()
    assert _close(remote_metrics, local_metrics, 1e-5)
  assert _close(remote.params, local.params, 1e-5)
  assert _close(remote.opt_state, local.opt_state, 1e-5)

  # Each process publishes its own shards to the store actor directly, in the background: the
  # call returns at once, the version appears whole once both parts are in, and the actors run
  # the next update only after the publication, which rank 0 records in its lane.
  store = RayWeightStore()
  remote.timeline = StageTimeline(record_compiles=False)
  before = remote.params
  remote.publish_to(store, 3)
  remote.update(batch)
  store.wait_for(3)
  version, published = store.pull(-1)
  assert version == 3 and _close(published, before, 0)
  assert not _close(published, remote.params, 0)
  kinds = [kind for lane, _, _, kind in remote.timeline.segments() if lane == LEARNER_LANE]
  assert kinds.count("weight-sync") == 1 and "train" not in kinds  # "train" is the caller's
  remote.timeline = None
  # For bf16 readers each process casts its shards before it sends them: half the bytes.
  bf16 = np.dtype(jax.numpy.bfloat16)
  remote.publish_to(store, 4, dtypes=jax.tree.map(lambda x: bf16, before))
  store.wait_for(4)
  version, published = store.pull(3)
  assert version == 4 and {x.dtype for x in jax.tree.leaves(published)} == {bf16}
  assert _close(_as_f32(published), _as_f32(remote.params, bf16), 0)

  # A checkpoint of the actor's state (host arrays) restores into it after more training.
  saved_params, saved_opt = remote.params, remote.opt_state
  ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=1)
  ckpt.save(1, params=saved_params, opt_state=saved_opt, loader_state={}, controller_state={})
  remote.update(batch)
  assert not _close(remote.params, saved_params, 0)
  restored = ckpt.restore(1, params=remote.params, opt_state=remote.opt_state)
  ckpt.close()
  remote.params, remote.opt_state = restored["params"], restored["opt_state"]
  assert _close(remote.params, saved_params, 0) and _close(remote.opt_state, saved_opt, 0)

  # The warm-up trains the actor's parameters in place.
  trainer = remote.supervised_trainer(1e-3)
  before = remote.params
  loss = [float(trainer.step(batch.tokens_bt, batch.mask_bt)["loss"]) for _ in range(3)]
  assert loss[2] < loss[0] and not _close(remote.params, before, 0)

  # A process of the gang lost: the next call says so (`job.run` then goes on from the last
  # checkpoint with a new learner), and the other process is stopped, not left waiting.
  ray.kill(remote._actors[1], no_restart=True)
  with pytest.raises(LearnerLost, match="A learner process died"):
    remote.update(batch)


def test_a_learner_actor_with_a_bad_config_says_why_when_built(local_ray):
  cfg = async_config(**{"loop.backend": "ray", "train.micro_batch_size": 8})
  with pytest.raises(ConfigError, match="multiple of the training mesh's data\\*fsdp size 16"):
    RayLearner(cfg, {"fsdp": 16})
  with pytest.raises(ConfigError, match="num_processes=3: the training mesh .* has 4 devices"):
    RayLearner(cfg, {"fsdp": 4}, num_processes=3)  # before any actor starts


@pytest.mark.slow  # two actor processes and a join timeout: about a minute on a loaded machine
def test_a_coordinator_no_learner_reaches_is_a_clear_error_not_a_hang(local_ray):
  cfg = async_config(**{"loop.backend": "ray", "train.micro_batch_size": 8})
  start = time.monotonic()
  with pytest.raises(RuntimeError, match="coordinator 10.255.255.1:1234 .* unreachable"):
    RayLearner(cfg, {"fsdp": 2}, num_processes=2, coordinator="10.255.255.1:1234",
               join_timeout_s=5)  # fmt: skip
  assert time.monotonic() - start < 120


def test_local_and_ray_workers_build_the_same_engine_mesh(local_ray):
  """The MoE variant's rollout mesh is data 2 x expert 2: a worker of 4 devices keeps the
  expert axis whether the local backend makes it (a thread here) or the Ray backend (an actor);
  both build it with `policy.rollout_worker_mesh`. A Ray worker used to keep the data axis
  alone. (The backends are made from the job's parts directly: no learner is built.)"""
  cfg = tiny_config("moe", **{"loop.mode": "async", "loop.rollout_workers": 1})
  tokenizer = make_tokenizer(cfg)
  rollout_model = Model(rollout_model_config(cfg, model_config(cfg, tokenizer)))
  parts = JobParts(cfg, place_stages(cfg, 16), rollout_model, tokenizer, 16)
  local, remote = LocalBackend(parts), RayBackend(parts)
  (slot,) = local.worker_slots()
  thread = local.make_worker("w0", slot, WeightStore())
  actor = remote.make_worker("w1", None, RayWeightStore())
  try:
    assert dict(thread.engine.mesh.shape)["expert"] == 2
    assert actor.mesh_shape() == dict(thread.engine.mesh.shape)
  finally:
    actor.kill()
