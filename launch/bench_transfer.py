"""Weight transfer: a version from a learner of P processes to R rollout readers, on Ray.

  python launch/bench.py weight_transfer [--json] [--presets bench-small,qwen3-0.6b]

Each case starts a learner gang (`ray_learner.RayLearner`, P processes, fsdp over all their
devices) and R reader actors on a local Ray cluster. One transfer: the learner publishes a new
version (each process sends its own shards to the store actor, which assembles the version),
then every reader pulls it from the store and places it on its own device, as a rollout
worker does. Reported: seconds to the store (`publish_s`) and until every reader holds it
(`transfer_s`), the bytes moved (the parameters once into the store and once per reader), and
the effective rate; beside them the local copy bandwidth of this machine, measured in the same
run (`memcpy_GBps`).
"""

import time

import jax
import numpy as np
import ray

from jaxrl.config import load_config
from jaxrl.rl.ray_backend import RayWeightStore
from jaxrl.rl.ray_learner import RayLearner, local_devices

# (preset, learner processes, readers): the 0.6B cases stay within a 24 GiB machine.
CASES = {
  "bench-small": [(1, 1), (1, 2), (2, 1), (2, 2)],
  "qwen3-0.6b": [(1, 1), (2, 1)],
}


@ray.remote(num_cpus=0)
class _Reader:
  """A rollout instance's side of a transfer: pull the version and place it on a device."""

  def __init__(self):
    self.device = local_devices(1, "A reader")[0]

  def pull(self, store_actor, have: int) -> float:
    start = time.perf_counter()
    pulled = ray.get(store_actor.pull.remote(have))
    placed = jax.device_put(pulled[1], self.device)
    jax.block_until_ready(placed)
    return time.perf_counter() - start


def _memcpy_gbps(size_mb: int = 512, repeats: int = 5) -> float:
  src = np.ones(size_mb * 2**18, np.float32)
  best = min(_timed(lambda: src.copy()) for _ in range(repeats))
  return src.nbytes / best / 1e9


def _timed(f) -> float:
  start = time.perf_counter()
  f()
  return time.perf_counter() - start


def bench_weight_transfer(presets=tuple(CASES), repeats: int = 3) -> dict:
  """Median of `repeats` transfers per (preset, P, R), after one that warms up."""
  started = not ray.is_initialized()
  if started:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  out = {"memcpy_GBps": _memcpy_gbps()}
  try:
    for preset in presets:
      for processes, readers in CASES.get(preset, [(1, 1)]):
        out[f"{preset} P{processes} R{readers}"] = _case(preset, processes, readers, repeats)
  finally:
    if started:
      ray.shutdown()
  return out


def _case(preset: str, processes: int, readers: int, repeats: int) -> dict:
  overrides = {
    "model": preset,
    "loop.backend": "ray",
    "loop.mode": "async",
    "train.optimizer.mu_dtype": "bfloat16",
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "train.micro_batch_size": 2,
  }
  cfg = load_config("configs/grpo_tiny.py", "test", _with_model(overrides))
  learner = RayLearner(cfg, {"fsdp": processes}, num_processes=processes)
  store = RayWeightStore(timeout_s=600)
  reader_actors = [_Reader.remote() for _ in range(readers)]
  publish, transfer = [], []
  try:
    for version in range(repeats + 1):
      start = time.perf_counter()
      learner.publish_to(store, version)
      store.wait_for(version)
      stored = time.perf_counter() - start
      ray.get([r.pull.remote(store.actor, version - 1) for r in reader_actors])
      if version:  # the first warms up (compiles nothing, but allocates)
        publish.append(stored)
        transfer.append(time.perf_counter() - start)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(store.pull(-1)[1]))
  finally:
    learner.kill()
    for r in reader_actors:
      ray.kill(r)
  moved = nbytes * (1 + readers)
  return {
    "param_bytes": nbytes,
    "bytes_moved": moved,
    "publish_s": float(np.median(publish)),
    "transfer_s": float(np.median(transfer)),
    "effective_GBps": moved / float(np.median(transfer)) / 1e9,
  }


def _with_model(overrides: dict) -> dict:
  """`model` as a preset's fields (what `config.model = model_config(...)` does)."""
  import dataclasses

  from jaxrl.model import get_preset

  preset = get_preset(overrides.pop("model"))
  return overrides | {f"model.{k}": v for k, v in dataclasses.asdict(preset).items()}
