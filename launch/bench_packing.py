"""Sequence packing against padded batches in the learner, on one device (an accelerator).

  python launch/bench_packing.py [all|fp32|run|tiny] [steps]

- `fp32`: one optimizer update of `bench-small` (fp32, matmuls at highest precision) on 16
  sequences, padded and packed: loss, gradient norm, entropy, clip fraction and the largest
  difference between the updated parameters.
- `run`: a long-tailed GRPO-like run, bf16 compute: per step 64 sequences of a 128-token
  prompt and a lognormal response (median 150 tokens, capped at 1024), padded to
  `jaxrl.rl.experience.batch_length` buckets as the RL loop pads them, two optimizer updates
  over micro-batches of 8 (rows when packed, rows of `auto_pack_length` positions). Per step
  wall time (compilation included) and the number of compiled update shapes.
- `tiny` (CPU, 8 simulated devices): the demo's learner (`configs/grpo_tiny.py`: tiny model,
  128 sequences of a 13-token prompt and 1-8 response tokens per step, two updates over
  micro-batches of 32, training mesh fsdp 4), padded and packed into rows of 24 and of 64
  positions, their steps interleaved on the same batches; median train step time.

Figures: docs/BENCHMARKS.md. Writes pack_<which>.json to $OUT (or /tmp).
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model import Model, get_preset
from jaxrl.sharding import TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, OptimizerConfig, TrainBatch
from jaxrl.train.packing import auto_pack_length


def batch_length(longest: int) -> int:
  """`jaxrl.rl.experience.batch_length` (not imported: that module pulls in the engines)."""
  if longest <= 128:
    return max(8, -(-longest // 8) * 8)
  step = (1 << ((longest - 1).bit_length() - 1)) // 4
  return -(-longest // step) * step


def make_batch(rng, n: int, prompt: int, cap: int, vocab: int) -> TrainBatch:
  responses = np.clip(rng.lognormal(np.log(150), 0.9, n).astype(int), 1, cap)
  length = batch_length(int((prompt + responses).max()))
  tokens = np.zeros((n, length), np.int32)
  mask = np.zeros((n, length - 1), np.float32)
  for i, r in enumerate(responses):
    tokens[i, : prompt + r] = rng.integers(3, vocab, prompt + r)
    mask[i, prompt - 1 : prompt + r - 1] = 1
  old = np.where(mask > 0, rng.normal(-2.0, 0.5, mask.shape), 0).astype(np.float32)
  return TrainBatch(tokens, mask, old, rng.normal(size=n).astype(np.float32))


def learner(model: Model, pack: int, micro: int, params) -> Learner:
  return Learner(
    model,
    make_mesh(jax.devices()[:1], {"fsdp": 1}),
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(learning_rate=1e-5, eps=1.0),
    updates_per_step=2,
    micro_batch_size=micro,
    temperature=1.0,
    params=params,
    pack_length=pack,
  )


def fp32_agreement() -> dict:
  with jax.default_matmul_precision("highest"):
    model = Model(get_preset("bench-small", max_seq_len=512))
    batch = make_batch(np.random.default_rng(0), 16, 32, 200, model.config.vocab_size)
    params = model.init(1)
    padded = learner(model, 0, 4, jax.tree.map(jnp.copy, params))
    packed = learner(model, 256, 4, jax.tree.map(jnp.copy, params))
    want, got = jax.device_get(padded.update(batch)), jax.device_get(packed.update(batch))
    diff = max(
      float(jnp.max(jnp.abs(x - y)))
      for x, y in zip(jax.tree.leaves(padded.params), jax.tree.leaves(packed.params), strict=True)
    )
  keys = ("loss", "grad_norm", "entropy", "clip_frac")
  return {
    "padded_packed": {k: [float(want[k]), float(got[k])] for k in keys},
    "max_param_diff": diff,
  }


def long_tailed_run(steps: int) -> dict:
  cfg = get_preset("bench-small", dtype="bfloat16", max_seq_len=1152)
  model = Model(cfg)
  prompt, cap = 128, 1024
  params = model.init(0)
  out = {}
  for name, pack in (("packed", auto_pack_length(cfg.max_seq_len, cap, prompt)), ("padded", 0)):
    rng = np.random.default_rng(1)
    trainer = learner(model, pack, 8, jax.tree.map(jnp.copy, params))
    times, lengths = [], []
    for _ in range(steps):
      batch = make_batch(rng, 64, prompt, cap, cfg.vocab_size)
      start = time.perf_counter()
      jax.block_until_ready(jax.device_get(trainer.update(batch)))
      times.append(time.perf_counter() - start)
      lengths.append(batch.tokens_bt.shape[1])
    out[name] = {
      "pack_length": pack,
      "batch_lengths": lengths,
      "compiled_update_shapes": trainer.compiled_shapes("micro_step" if pack else "update"),
      "step_s": [round(t, 3) for t in times],
      "total_s": round(sum(times), 1),
      "median_last6_s": round(float(np.median(times[-6:])), 3),
    }
    print(name, json.dumps(out[name]), flush=True)
  return out


def tiny_demo(steps: int) -> dict:
  model = Model(get_preset("tiny"))
  rng = np.random.default_rng(0)
  params = model.init(0)

  def batch():
    tokens = np.zeros((128, 24), np.int32)
    mask = np.zeros((128, 23), np.float32)
    for i, r in enumerate(rng.integers(1, 9, 128)):
      tokens[i, : 13 + r] = rng.integers(3, 60, 13 + r)
      mask[i, 12 : 12 + r] = 1
    old = np.where(mask > 0, -2.0, 0.0).astype(np.float32)
    return TrainBatch(tokens, mask, old, rng.normal(size=128).astype(np.float32))

  learners = {
    pack: Learner(
      model,
      make_mesh(jax.devices()[4:], {"fsdp": 4}),
      TRAIN_RULES,
      loss=LossConfig(),
      optimizer=OptimizerConfig(learning_rate=1e-4),
      updates_per_step=2,
      micro_batch_size=32,
      temperature=1.0,
      params=jax.tree.map(np.asarray, params),
      pack_length=pack,
    )  # fmt: skip
    for pack in (0, 24, 64)
  }
  for trainer in learners.values():  # compile
    jax.block_until_ready(jax.device_get(trainer.update(batch())))
  times = {pack: [] for pack in learners}
  for _ in range(steps):
    b = batch()
    for pack, trainer in learners.items():
      start = time.perf_counter()
      jax.block_until_ready(jax.device_get(trainer.update(b)))
      times[pack].append(time.perf_counter() - start)
  out = {f"pack_{k}_median_s": round(float(np.median(v)), 3) for k, v in times.items()}
  out["load_average"] = os.getloadavg()
  print(json.dumps(out), flush=True)
  return out


def main(which: str = "all", steps: str = "14") -> None:
  if which == "tiny":
    jax.config.update("jax_num_cpu_devices", 8)
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
  if which == "tiny":
    out["tiny"] = tiny_demo(int(steps))
  if which in ("all", "fp32"):
    out["fp32"] = fp32_agreement()
    print(json.dumps(out["fp32"]), flush=True)
  if which in ("all", "run"):
    out["run"] = long_tailed_run(int(steps))
  path = os.path.join(os.environ.get("OUT", "/tmp"), f"pack_{which}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  if sys.argv[1:2] == ["tiny"]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main(*sys.argv[1:])
