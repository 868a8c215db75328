"""Weight transfer: a version from a learner of P processes to R rollout readers, on Ray.

  python launch/bench.py weight_transfer [--json] [--presets bench-small,qwen3-0.6b]

Each case starts a learner gang (`ray_learner.RayLearner`, P processes, fsdp over all their
devices) and R reader actors on a local Ray cluster. One transfer: the learner publishes a new
version (each process sends its own shards to the store actor, which assembles the version),
then every reader pulls it from the store and places it on its own device, as a rollout
worker does; in the "bf16 readers" cases each learner process first casts its shards to bf16
(`publish_to(..., dtypes=)`, what a bf16 rollout of fp32 master weights gets). Reported:
seconds to the store (`publish_s`) and until every reader holds it (`transfer_s`), the bytes
moved (the parameters once into the store and once per reader, in the sent dtype), and the
effective rate; beside them the local copy bandwidth of this machine, measured in the same run
(`memcpy_GBps`).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import ray

from jaxrl.config import load_config
from jaxrl.model import Model
from jaxrl.rl.policy import make_tokenizer, model_config
from jaxrl.rl.ray_backend import RayWeightStore
from jaxrl.rl.ray_learner import RayLearner, local_devices
from jaxrl.rl.weights import from_wire

# preset -> (learner processes, readers, cast to bf16 readers): the 0.6B cases (the preset's
# bf16 weights) stay within a 24 GiB machine (with fp32 master weights Ray ran out of memory
# there). Cast: the learner casts its shards before it sends them (bench-small's fp32 weights
# to a bf16 rollout's).
CASES = {
  "bench-small": [
    (1, 1, False),
    (1, 1, True),
    (1, 2, False),
    (1, 2, True),
    (2, 1, False),
    (2, 2, False),
  ],
  "qwen3-0.6b": [(1, 1, False), (2, 1, False)],
}


@ray.remote(num_cpus=0)
class _Reader:
  """A rollout instance's side of a transfer: pull the version and place it on a device."""

  def __init__(self):
    self.device = local_devices(1, "A reader")[0]

  def pull(self, store_actor, have: int) -> float:
    start = time.perf_counter()
    pulled = from_wire(ray.get(store_actor.pull.remote(have)))
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
      for processes, readers, cast in CASES.get(preset, [(1, 1, False)]):
        name = f"{preset} P{processes} R{readers}" + (" bf16 readers" if cast else "")
        out[name] = _case(preset, processes, readers, cast, repeats)
  finally:
    if started:
      ray.shutdown()
  return out


def _case(preset: str, processes: int, readers: int, cast: bool, repeats: int) -> dict:
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
  # The readers' dtypes, a tree like the parameters' (what the controller passes).
  abstract = Model(model_config(cfg, make_tokenizer(cfg))).abstract_params()
  dtypes = jax.tree.map(lambda a: jnp.dtype(jnp.bfloat16), abstract) if cast else None
  try:
    for version in range(repeats + 1):
      start = time.perf_counter()
      learner.publish_to(store, version, dtypes=dtypes)
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
  """`model` as a preset's fields (what `config.model = model_config(...)` does), under the
  other `model.*` overrides."""
  import dataclasses

  from jaxrl.model import get_preset

  preset = get_preset(overrides.pop("model"))
  return {f"model.{k}": v for k, v in dataclasses.asdict(preset).items()} | overrides
