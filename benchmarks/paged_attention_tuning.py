"""Block-size sweep of the GPU paged attention kernel, to check the defaults it derives.

  JAX_PLATFORMS=cuda python benchmarks/paged_attention_tuning.py [--json] [--shapes A,B]
      [--grid long|short] [--in-loop 50]

For a few decode shapes of `launch/bench.py paged_attention`, times the kernel with its
default block sizes and with every combination of pages per compute block, splits, warps and
stages, and prints each shape's default time next to the best found. Needs a GPU.
`--grid short` sweeps small compute blocks, few warps and stages instead: for contexts of a
few pages, where the kernel is bound by latency, not bandwidth. `--in-loop N` times N calls
inside one jitted loop (per call: the kernel's time, without a host dispatch each); short
contexts need it.
"""

import argparse
import functools
import itertools
import json
import os
import sys

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "launch"))

import bench  # noqa: E402

from jaxrl.kernels.paged_attention import BlockSizes, paged_attention  # noqa: E402

SHAPES = ("qwen3-8b_64x2k", "qwen3-8b_256x1k", "qwen3-8b_16x8k")
# (pages per compute block, splits, warps, stages) to sweep.
GRIDS = {
  "long": ((4, 8, 16), (None, 1, 2, 4, 8), (4, 8), (2, 3)),
  "short": ((1, 2, 4, 8), (None, 2), (1, 2, 4), (1, 2)),
}


def _inputs(rng, n, h, k, d, s, context, dtype):
  if context > 0:
    lengths = np.full(n, context, np.int32)
  else:
    lengths = np.clip(np.round(rng.lognormal(np.log(-context), 1.0, n)), 1, -8 * context)
    lengths = lengths.astype(np.int32)
  m = -(-int(lengths.max()) // s)
  p = n * m
  return (
    jax.numpy.asarray(rng.standard_normal((n, h, d)), dtype),
    jax.numpy.asarray(rng.standard_normal((k, p, s, d), np.float32), dtype),
    jax.numpy.asarray(rng.standard_normal((k, p, s, d), np.float32), dtype),
    jax.numpy.asarray(lengths),
    jax.numpy.asarray(rng.permutation(p).reshape(n, m).astype(np.int32)),
  )


def calls_in_a_loop(attention, calls: int):
  """`attention(q, k_pages, v_pages, lengths, pages)` `calls` times in one jitted loop, each
  call's output the next one's q: the kernel's time without a host dispatch per call, which
  at short contexts exceeds it (a call of the jitted function alone took 39-66 us on an H100
  where the kernel inside the model took 17-20 us)."""

  def run(q, k_pages, v_pages, lengths, pages):
    def body(_, q):
      return attention(q, k_pages, v_pages, lengths, pages).astype(q.dtype)

    return jax.lax.fori_loop(0, calls, body, q)

  return jax.jit(run)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--shapes", default=",".join(SHAPES), help="names from ATTENTION_CASES")
  parser.add_argument("--grid", default="long", choices=sorted(GRIDS))
  loop_help = "time each configuration as this many calls in one jitted loop (0: call by call)"
  parser.add_argument("--in-loop", type=int, default=0, help=loop_help)
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    raise SystemExit("paged_attention_tuning needs a GPU backend (JAX_PLATFORMS=cuda).")
  rng = np.random.default_rng(0)
  cases = {case[0]: case[1:] for case in bench.ATTENTION_CASES}
  out = {}
  for name in args.shapes.split(","):
    inputs = _inputs(rng, *cases[name], jax.numpy.bfloat16)
    timings = {}
    grid = itertools.product(*GRIDS[args.grid])
    for c, x, warps, stages in [(None, None, None, None), *grid]:
      block_sizes = None if c is None else BlockSizes(c, x, warps, stages)
      attention = functools.partial(paged_attention, impl="pallas_gpu", block_sizes=block_sizes)
      calls = max(args.in_loop, 1)
      fn = calls_in_a_loop(attention, calls) if args.in_loop else jax.jit(attention)
      try:
        seconds = bench._best_seconds(lambda fn=fn, inputs=inputs: fn(*inputs), repeats=20)
        seconds /= calls
      except Exception as e:  # a tiling Triton cannot compile (shared memory, registers)
        timings[str(block_sizes)] = f"failed: {type(e).__name__}"
        continue
      timings["default" if block_sizes is None else str(block_sizes)] = seconds * 1e6
    measured = {k: v for k, v in timings.items() if isinstance(v, float) and k != "default"}
    best = min(measured, key=measured.get)
    out[name] = {
      "default_us": timings["default"],
      "best_us": measured[best],
      "best": best,
      "default_over_best": timings["default"] / measured[best],
      "failed": sum(isinstance(v, str) for v in timings.values()),
    }
    print(name, out[name], flush=True)
    out[name]["all_us"] = measured  # every configuration that compiled, for choosing defaults
  if args.json:
    print(json.dumps(out))


if __name__ == "__main__":
  main()
