"""Block-size sweep of the GPU flash attention kernels, to choose their (untuned) defaults.

  JAX_PLATFORMS=cuda python benchmarks/flash_attention_tuning.py [--json] [--lengths 4096,16384]

One layer of Qwen3-0.6B attention (16 query heads, 8 kv heads, head_dim 128), bf16, one causal
row of L tokens (the learner's packed rows at the lengths `launch/bench.py learner` runs). For
each forward tiling (`FORWARD`: block_q, block_kv, warps, stages) the forward's time; for each
backward tiling (`BACKWARD`: block_q_bwd, block_kv_bwd, warps, stages: `num_warps_bwd` and
`num_stages_bwd`, and for some `block_q_dq` and `block_kv_dq`) the gradient's time (forward +
dq + dk/dv, the forward at its defaults) less the default forward's. Also the defaults under
`pallas_gpu.mask_every_block` (every block pair masked, as before the kernels skipped the
mask on pairs that see each other whole) and under `pallas_gpu.natural_exp` (libdevice's
expf, as before the softmax worked in base 2). Each time: best of 10 calls after a warm-up
(`launch/bench_attention.py`'s clock),
compilation excluded; TFLOP/s = causal attention FLOPs (forward 2 matmuls, backward 5) over
it. Prints each length's default next to the best found. Needs a GPU.
"""

import argparse
import contextlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch")
)

from bench_attention import HEAD_DIM, HEADS, KV_HEADS, _best_seconds  # noqa: E402

from jaxrl.kernels.flash_attention import BlockSizes, flash_attention, pallas_gpu  # noqa: E402

# (block_q, block_kv, warps, stages); None everywhere: the defaults.
FORWARD = (
  (None, None, None, None),
  (128, 64, 8, 3),
  (128, 128, 8, 2),
  (128, 64, 4, 3),
  (64, 64, 4, 3),
  (128, 32, 4, 4),
)
# (block_q_bwd, block_kv_bwd, warps, stages[, block_q_dq, block_kv_dq]: dq tiled apart from
# dk/dv). Compiled for an H100 without one (`launch/bench.py kernel_code`,
# docs/BENCHMARKS.md), 32 x 128 with 4 warps spilled 5 KB a thread in dk/dv and 64 x 32 with
# 4 warps 0.5 KB: left out. Blocks of 32 queries run dq on mma.sync, not wgmma, hence the
# 32 x 128 dk/dv tilings with dq at 64 x 64 or 128 x 32 (the tiles of Triton's own fused
# attention tutorial for Hopper: small query blocks for dk/dv, large ones for dq).
BACKWARD = (
  (None, None, None, None),
  (64, 64, 8, 3),
  (64, 64, 4, 2),
  (32, 64, 4, 3),
  (64, 128, 8, 2),
  (32, 128, 8, 3),
  (32, 128, 8, 2),
  (128, 64, 8, 2),
  (32, 128, 8, 3, 64, 64),
  (32, 128, 8, 3, 128, 32),
)


def _time(length: int, block_sizes, *, backward: bool, setting=None) -> float:
  rng = np.random.default_rng(0)

  def put(*shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

  q, cot = put(1, length, HEADS, HEAD_DIM), put(1, length, HEADS, HEAD_DIM)
  k, v = put(1, length, KV_HEADS, HEAD_DIM), put(1, length, KV_HEADS, HEAD_DIM)

  def attend(q, k, v):
    return flash_attention(q, k, v, impl="pallas_gpu", block_sizes=block_sizes)

  def loss(q, k, v):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if backward else attend)
  with setting() if setting else contextlib.nullcontext():
    compiled = fn.lower(q, k, v).compile()
  return _best_seconds(lambda: compiled(q, k, v), repeats=10)


def _flops(length: int, matmuls: int) -> float:
  # Causal: about half of the L x L pairs; each matmul 2 * head_dim flops a pair and head.
  return matmuls * 2 * HEAD_DIM * HEADS * length * length / 2


def sweep(length: int) -> dict:
  out: dict = {"forward": {}, "backward": {}}
  for bq, bk, warps, stages in FORWARD:
    blocks = BlockSizes(block_q=bq, block_kv=bk, num_warps=warps, num_stages=stages)
    name = "default" if bq is None else f"{bq}x{bk} w{warps} s{stages}"
    try:
      seconds = _time(length, blocks, backward=False)
      out["forward"][name] = {"ms": seconds * 1e3, "tflops": _flops(length, 2) / seconds / 1e12}
    except Exception as e:  # noqa: BLE001  (a tiling Triton cannot compile: shared memory)
      out["forward"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
  for bq, bk, warps, stages, *dq in BACKWARD:
    blocks = BlockSizes(
      block_q_bwd=bq, block_kv_bwd=bk, num_warps_bwd=warps, num_stages_bwd=stages,
      block_q_dq=dq[0] if dq else None, block_kv_dq=dq[1] if dq else None,
    )  # fmt: skip
    name = "default" if bq is None else f"{bq}x{bk} w{warps} s{stages}"
    name += f" dq {dq[0]}x{dq[1]}" if dq else ""
    try:
      both = _time(length, blocks, backward=True)
      forward = _time(length, blocks, backward=False)
      seconds = both - forward
      out["backward"][name] = {
        "ms": seconds * 1e3,
        "tflops": _flops(length, 5) / seconds / 1e12,
        "fwd_bwd_ms": both * 1e3,
      }
    except Exception as e:  # noqa: BLE001
      out["backward"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
  for name in ("mask_every_block", "natural_exp"):
    setting = getattr(pallas_gpu, name)
    out[name] = {
      "forward_ms": _time(length, None, backward=False, setting=setting) * 1e3,
      "fwd_bwd_ms": _time(length, None, backward=True, setting=setting) * 1e3,
    }
  for part in ("forward", "backward"):
    timed = {k: v["ms"] for k, v in out[part].items() if "ms" in v and k != "default"}
    if timed and "ms" in out[part]["default"]:
      best = min(timed, key=timed.get)
      out[f"{part}_best"] = {
        "tiling": best,
        "ms": timed[best],
        "default_over_best": out[part]["default"]["ms"] / timed[best],
      }
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--lengths", default="4096,16384")
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("flash_attention_tuning needs a GPU backend (JAX_PLATFORMS=cuda).")
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
  for length in (int(n) for n in args.lengths.split(",")):
    out[f"L{length}"] = sweep(length)
    summary = {k: v for k, v in out[f"L{length}"].items() if k.endswith("_best")}
    print(f"L{length}", json.dumps(summary), flush=True)
  if args.json:
    print(json.dumps(out))


if __name__ == "__main__":
  main()
