"""`python launch/bench.py gmm`: the grouped matmul of MoE experts against XLA's `ragged_dot`.

Shapes of Qwen3-30B-A3B's expert matmuls (k = d_model 2048, n = expert mlp_dim 768) at m =
8,192 and 16,384 routed rows over 8, 64 and 128 groups; group sizes drawn as a router would
leave them (a multinomial over uniform probabilities, so groups differ by a few percent),
bf16 in, bf16 out, float32 accumulation. Each implementation computes the same product; its
largest difference from `ragged_dot`'s output, relative to that output's largest magnitude,
is reported beside its time.

Implementations, on a GPU: `ragged_dot` (the baseline, same run) and the Pallas GPU kernel
(`jaxrl.kernels.gmm`, row tiles aligned to group starts) at its default tiles and at each
tile setting of `TILES`. Elsewhere
(CPU) only `ragged_dot` and the reference on two small shapes, so that the command runs anywhere.
Time = median over `rounds` of the mean of `calls` back-to-back calls (dispatch overlaps the
device work), compilation excluded. TFLOP/s = 2 m k n over that time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.gmm import BlockSizes, gmm, tgmm

# (m, k, n, groups)
CASES = tuple((m, 2048, 768, g) for g in (128, 64, 8) for m in (16384, 8192))
# (tm, tk, tn, num_warps, num_stages): Hopper-sized Triton tiles to try beside the default
# (the first, the small tiles every GPU fits, was tgmm's default on Hopper before the H100
# sweep of 2026-11-27; the last two are larger than that sweep's best, tgmm's default since).
TILES = (
  (64, 32, 64, 4, 2),
  (64, 64, 128, 4, 3),
  (64, 64, 256, 8, 3),
  (128, 64, 128, 8, 3),
  (128, 64, 256, 8, 3),
  (128, 32, 128, 4, 4),
  (128, 64, 128, 4, 4),
  (128, 128, 128, 8, 3),
  (64, 128, 256, 8, 3),
)


def _seconds_per_call(fn, *args, calls: int = 20, rounds: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  means = []
  for _ in range(rounds):
    start = time.perf_counter()
    out = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(out)
    means.append((time.perf_counter() - start) / calls)
  return statistics.median(means)


def _implementations(op, baseline: str, baseline_fn, on_gpu: bool) -> dict:
  """name -> jitted f(lhs, second operand, group_sizes): XLA's `baseline_fn` under `baseline`,
  then `op` (`gmm` or `tgmm`): the reference on CPU; on a GPU the Pallas kernel at its default
  tiles and at each of `TILES`."""
  impls = {baseline: jax.jit(baseline_fn)}
  if not on_gpu:
    impls["reference"] = jax.jit(lambda x, y, s: op(x, y, s, impl="reference"))
    return impls
  impls["pallas_gpu"] = jax.jit(lambda x, y, s: op(x, y, s, impl="pallas_gpu"))
  for tm, tk, tn, warps, stages in TILES:
    bs = BlockSizes(tm=tm, tk=tk, tn=tn, num_warps=warps, num_stages=stages)
    impls[f"pallas_gpu_{tm}x{tk}x{tn}_w{warps}s{stages}"] = jax.jit(
      lambda x, y, s, bs=bs: op(x, y, s, impl="pallas_gpu", block_sizes=bs)
    )
  return impls


def _bench(label: str, impls: dict, baseline: str, vs: str, second_operand, cases, seed) -> dict:
  """Each case's rows: every implementation's time, TFLOP/s (2 m k n) and largest difference
  from `baseline`'s output, and the best kernel against `baseline` (keys `..._vs_<vs>`).
  `second_operand(rng, m, k, n, g)`: the bf16 array beside the `[m, k]` rows."""
  calls = 20
  if jax.default_backend() != "gpu":
    # XLA:CPU's ragged_dot computes every group for every row: small shapes only.
    cases, calls = ((256, 512, 256, 8), (256, 512, 256, 64)), 2
  rng = np.random.default_rng(seed)
  out = {"machine": {"backend": jax.default_backend(), "device": str(jax.devices()[0])}}
  for m, k, n, g in cases:
    sizes = rng.multinomial(m, np.full(g, 1 / g)).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    other = second_operand(rng, m, k, n, g)
    group_sizes = jnp.asarray(sizes)
    ref = np.asarray(impls[baseline](lhs, other, group_sizes), np.float32)
    row = {"group_rows_min_max": [int(sizes.min()), int(sizes.max())]}
    for name, fn in impls.items():
      try:
        got = np.asarray(fn(lhs, other, group_sizes), np.float32)
        seconds = _seconds_per_call(fn, lhs, other, group_sizes, calls=calls)
      except Exception as e:  # a tile setting the compiler refuses: say so, go on
        row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        continue
      row[name] = {
        "us": seconds * 1e6,
        "tflops": 2 * m * k * n / seconds / 1e12,
        "max_rel_diff": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))),
      }
    kernels = {name: r for name, r in row.items() if name.startswith("pallas_gpu") and "us" in r}
    if kernels and "us" in row.get(baseline, {}):
      best = min(kernels, key=lambda name: kernels[name]["us"])
      row["best_kernel"] = best
      row[f"best_kernel_vs_{vs}"] = row[baseline]["us"] / kernels[best]["us"]
      if "pallas_gpu" in kernels:
        row[f"default_vs_{vs}"] = row[baseline]["us"] / kernels["pallas_gpu"]["us"]
    name = f"m{m}_k{k}_n{n}_g{g}"
    out[name] = row
    print("progress", json.dumps({f"{label}{name}": row}), file=sys.stderr, flush=True)
  return out


def bench_gmm(cases=CASES, seed: int = 0) -> dict:
  impls = _implementations(gmm, "ragged_dot", jax.lax.ragged_dot, jax.default_backend() == "gpu")

  def rhs(rng, m, k, n, g):
    return jnp.asarray(rng.standard_normal((g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)

  return _bench("", impls, "ragged_dot", "ragged_dot", rhs, cases, seed)


def _ragged_dot_weight_gradient(lhs, grad, sizes):
  """XLA's weight gradient of `ragged_dot` (its transpose rule): `tgmm`'s baseline."""
  rhs = jnp.zeros((sizes.shape[0], lhs.shape[1], grad.shape[1]), lhs.dtype)
  _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(lhs, w, sizes), rhs)
  return vjp(grad)[0]


def bench_tgmm(cases=CASES, seed: int = 0) -> dict:
  """`tgmm` (gmm's weight gradient, `out[g] = lhs[rows of g].T @ grad[rows of g]`) against
  XLA's weight gradient of `ragged_dot` on the same shapes as `bench_gmm` (lhs `[m, k]`, grad
  `[m, n]`, bf16 in and out), at its default tiles (64x32x64, untuned) and at `TILES`; on CPU
  the reference on two small shapes. Time and TFLOP/s (2 m k n) as in `bench_gmm`."""
  on_gpu = jax.default_backend() == "gpu"
  impls = _implementations(tgmm, "ragged_dot_vjp", _ragged_dot_weight_gradient, on_gpu)

  def grad(rng, m, k, n, g):
    return jnp.asarray(rng.standard_normal((m, n), np.float32) / np.sqrt(m / g), jnp.bfloat16)

  return _bench("tgmm ", impls, "ragged_dot_vjp", "xla", grad, cases, seed)
