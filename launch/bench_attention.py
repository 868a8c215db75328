"""`python launch/bench_attention.py [--json]`: flash attention against dense attention, one layer.

One layer of Qwen3-0.6B attention (16 query heads, 8 kv heads, head_dim 128) over one causal
row of L tokens, at a few L. For each implementation: the time of a forward + backward pass
(gradients of sum(out * cot) in q, k and v; best of a few calls after a warm-up; compilation
excluded) and XLA's buffer plan of the compiled step (`memory_analysis()`): the temporaries of
the forward alone and of forward + backward (arguments and outputs excluded), which is where
dense attention's `[heads, L, L]` scores and probabilities live. Also the largest difference
of each output from dense attention's.

Implementations, on whatever backend runs this:
- `dense`: `jaxrl.model.cache.dot_attention`, the model's attention today (autodiff keeps the
  probabilities for the backward pass);
- `flash_reference`: `jaxrl.kernels.flash_attention` with `impl="reference"` (blockwise jnp,
  the CPU path);
- `flash_pallas_gpu` / `flash_pallas_tpu`: the backend's kernel, on a GPU or TPU;
- `flash_pallas_gpu_mask_every_block`: the GPU kernel masking every block pair
  (`pallas_gpu.mask_every_block`), as it did before it skipped the mask on pairs that see
  each other whole: the A/B of that change;
- `flash_pallas_gpu_natural_exp`: the GPU kernel taking its softmax's exponentials with
  libdevice's expf (`pallas_gpu.natural_exp`), as it did before it worked in base 2;
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, on a GPU where it works.

And the same row packed with `PACKED_SEGMENTS` sequences of L / 4 tokens (segment ids, positions
restarting at 0), as the learner packs its rows: `dense_packed4` (`dot_attention` with segment
ids), `flash_reference_packed4`, `flash_pallas_gpu_packed4` and `cudnn_packed4`
(`flash_attention(impl="cudnn")`: cuDNN's packed layout); their differences are taken against
`dense_packed4`.

Float32 on CPU (XLA:CPU has no fast bf16 matmuls), bfloat16 elsewhere, unless `dtype` says.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.flash_attention import flash_attention
from jaxrl.model.cache import dot_attention

LENGTHS = (1024, 4096)
PACKED_SEGMENTS = 4
# Qwen3-0.6B attention.
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def _best_seconds(fn, repeats: int) -> float:
  """Best time of `repeats` calls after one warm-up call (the machine may be shared)."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def _implementations(platform: str) -> dict:
  """name -> attention(q_bthe, k_bske, v_bske, positions_bt) for this backend."""
  impls = {
    "dense": lambda q, k, v, pos: dot_attention(q, k, v, pos, pos),
    "flash_reference": lambda q, k, v, pos: flash_attention(q, k, v, impl="reference"),
  }
  kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform)
  if kernel:
    impls[f"flash_{kernel}"] = lambda q, k, v, pos: flash_attention(q, k, v, impl=kernel)
  if kernel == "pallas_gpu":
    # The kernel as it was before it skipped the mask where a block pair sees all of itself,
    # and before its softmax worked in base 2 (traced under `pallas_gpu.mask_every_block` and
    # `pallas_gpu.natural_exp`: `_tracing_context`).
    impls["flash_pallas_gpu_mask_every_block"] = impls["flash_pallas_gpu"]
    impls["flash_pallas_gpu_natural_exp"] = impls["flash_pallas_gpu"]
  if platform == "gpu":
    impls["cudnn"] = lambda q, k, v, pos: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"
    )

  def packed(impl):
    def attention(q, k, v, pos):
      seg, pos = _packed_ids(pos)
      if impl == "dense":
        return dot_attention(q, k, v, pos, pos, seg, seg)
      return flash_attention(q, k, v, q_segment_ids=seg, q_positions=pos, impl=impl)

    return attention

  packed_impls = ["dense", "reference"] + (["pallas_gpu", "cudnn"] if platform == "gpu" else [])
  for impl in packed_impls:
    name = impl if impl in ("dense", "cudnn") else f"flash_{impl}"
    impls[f"{name}_packed{PACKED_SEGMENTS}"] = packed(impl)
  return impls


def _packed_ids(pos_bt):
  """(segment ids, positions) of rows of `PACKED_SEGMENTS` equal sequences."""
  length = pos_bt.shape[1] // PACKED_SEGMENTS
  return pos_bt // length, pos_bt % length


def _tracing_context(name: str):
  """What `name`'s traces run under: the GPU kernel's A/B setting, or nothing."""
  from jaxrl.kernels.flash_attention import pallas_gpu

  settings = {
    "flash_pallas_gpu_mask_every_block": pallas_gpu.mask_every_block,
    "flash_pallas_gpu_natural_exp": pallas_gpu.natural_exp,
  }
  return settings[name]() if name in settings else contextlib.nullcontext()


def _mib(compiled) -> float:
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def bench_flash_attention(
  lengths=LENGTHS,
  batch: int = 1,
  heads: int = HEADS,
  kv_heads: int = KV_HEADS,
  head_dim: int = HEAD_DIM,
  dtype: str | None = None,
  repeats: int = 3,
) -> dict:
  """Times and buffer plans of each implementation at each length; returns row -> figures.

  An implementation that fails to compile or run at some length (cuDNN without a supported
  GPU, say) gets `error` in its row instead of figures.
  """
  device = jax.devices()[0]
  dt = jnp.dtype(dtype or ("float32" if device.platform == "cpu" else "bfloat16"))
  out = {
    "machine": {
      "platform": device.platform,
      "kind": device.device_kind,
      "jax": jax.__version__,
      "dtype": dt.name,
      "shape": f"batch {batch}, heads {heads}/{kv_heads}, head_dim {head_dim}",
    }
  }
  rng = np.random.default_rng(0)
  impls = _implementations(device.platform)
  for length in lengths:

    def put(shape):
      return jax.device_put(rng.standard_normal(shape, np.float32).astype(dt), device)

    q = put((batch, length, heads, head_dim))
    k, v = put((batch, length, kv_heads, head_dim)), put((batch, length, kv_heads, head_dim))
    cot = put((batch, length, heads, head_dim))
    pos = jax.device_put(np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)))
    dense_out = {}  # "" and "_packed4": the dense rows each variant is compared with
    for name, attn in impls.items():
      variant = f"_packed{PACKED_SEGMENTS}" if name.endswith(f"_packed{PACKED_SEGMENTS}") else ""
      row = {}
      try:
        fwd = jax.jit(attn)

        def loss(q, k, v, pos, cot, attn=attn):
          return jnp.sum(attn(q, k, v, pos).astype(jnp.float32) * cot.astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        with _tracing_context(name):
          fwd_compiled = fwd.lower(q, k, v, pos).compile()
          step_compiled = step.lower(q, k, v, pos, cot).compile()
        row["fwd_temp_MiB"] = _mib(fwd_compiled)
        row["fwd_bwd_temp_MiB"] = _mib(step_compiled)
        y = fwd_compiled(q, k, v, pos).astype(jnp.float32)
        if name == f"dense{variant}":
          dense_out[variant] = y
        else:
          row["max_abs_diff_vs_dense"] = float(jnp.max(jnp.abs(y - dense_out[variant])))
        row["fwd_bwd_ms"] = 1e3 * _best_seconds(
          functools.partial(step_compiled, q, k, v, pos, cot), repeats
        )
      except Exception as e:  # noqa: BLE001  (a missing backend feature is a result here)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      out[f"L{length} {name}"] = row
  return out


if __name__ == "__main__":
  result = bench_flash_attention()
  if "--json" in sys.argv[1:]:
    print(json.dumps(result))
  else:
    for key, row in result.items():
      print(
        f"{key}: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
      )
