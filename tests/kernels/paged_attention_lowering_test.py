"""Paged attention lowered for the platforms a CPU machine does not have: the TPU kernel
through Mosaic, the GPU kernel for CUDA (the Triton call, and in its Triton IR which dots it
takes at each precision), both also with a sliding window.

Shapes: n sequences, h query heads, k kv heads, g = h // k, d head dim, p pages in the pool,
s tokens per page, m pages per sequence.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from helpers.lowering import TRITON_CALL, export_cuda, triton_modules

from jaxrl.kernels.paged_attention import BlockSizes, paged_attention


def _shapes(n, h, k, d, p, s, m, dtype):
  sds = jax.ShapeDtypeStruct
  return (
    sds((n, h, d), dtype),
    sds((k, p, s, d), dtype),
    sds((k, p, s, d), dtype),
    sds((n,), jnp.int32),
    sds((n, m), jnp.int32),
  )


# (n, h, k, d, p, s, m, dtype, block_sizes): decode-sized shapes as a model would use them.
LOWERING_CASES = [
  (8, 32, 8, 128, 512, 16, 64, jnp.bfloat16, None),
  (3, 8, 8, 64, 100, 8, 5, jnp.float32, None),
  (16, 64, 8, 128, 2048, 32, 33, jnp.bfloat16, BlockSizes(pages_per_compute_block=4)),
  (2, 12, 4, 128, 64, 64, 7, jnp.float32, None),
  # Short page tables (<= 128 tokens), which the GPU kernel tiles apart: 2 warps, 1 stage.
  (64, 16, 8, 128, 384, 16, 6, jnp.bfloat16, None),
  (8, 64, 8, 64, 64, 16, 8, jnp.bfloat16, None),
  # Page tables past 2,048 tokens keep 128-token blocks at 4 warps and 2 stages (medium ones,
  # like the 1,024-token case above, take 64-token blocks at 2 warps and 1 stage).
  (4, 16, 8, 128, 640, 16, 136, jnp.bfloat16, None),
]


@pytest.mark.parametrize("n,h,k,d,p,s,m,dtype,block_sizes", LOWERING_CASES)
def test_tpu_kernel_lowers_for_tpu(n, h, k, d, p, s, m, dtype, block_sizes):
  f = functools.partial(paged_attention, impl="pallas_tpu", block_sizes=block_sizes)
  exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*_shapes(n, h, k, d, p, s, m, dtype))
  assert "tpu_custom_call" in exported.mlir_module()
  assert exported.out_avals[0].shape == (n, h, d) and exported.out_avals[0].dtype == dtype


@pytest.mark.parametrize("n,h,k,d,p,s,m,dtype,block_sizes", LOWERING_CASES)
def test_gpu_kernel_lowers_for_cuda(n, h, k, d, p, s, m, dtype, block_sizes):
  f = functools.partial(paged_attention, impl="pallas_gpu", block_sizes=block_sizes)
  exported = export_cuda(f, *_shapes(n, h, k, d, p, s, m, dtype))
  text = exported.mlir_module()
  assert TRITON_CALL in text
  assert exported.out_avals[0].shape == (n, h, d) and exported.out_avals[0].dtype == dtype
  modules = triton_modules(text)
  assert len(modules) == 1
  verified, triton_ir = modules[0]
  # By default 16-bit pools use tensor-core dots, float32 ones with g <= 4 CUDA-core sums.
  assert verified and ("tt.dot" in triton_ir) == (dtype == jnp.bfloat16 or h // k > 4)


# (g, dtype, precision, dot_min_group, Triton dots expected as (operand type, inputPrecision)),
# Qwen3-0.6B-sized heads (16 query heads, d = 128): float32 dots run on tensor cores (TF32
# parts), never as IEEE float32 dots, unless precision="highest" asks for them.
IR_CASES = [
  (2, jnp.float32, None, None, []),
  (2, jnp.float32, None, 1, 6 * [("f32", "tf32")]),
  (8, jnp.float32, "high", None, 6 * [("f32", "tf32")]),
  (8, jnp.float32, "default", None, 2 * [("f32", "tf32")]),
  (8, jnp.float32, "highest", 1, 2 * [("f32", "ieee")]),
  (8, jnp.float32, "highest", None, []),
  (2, jnp.bfloat16, None, None, 2 * [("bf16", None)]),
  (2, jnp.bfloat16, None, 4, []),
]


@pytest.mark.parametrize("g,dtype,precision,dot_min_group,dots", IR_CASES)
def test_gpu_kernel_dots_in_triton_ir(g, dtype, precision, dot_min_group, dots):
  k = 16 // g
  f = functools.partial(
    paged_attention,
    impl="pallas_gpu",
    precision=precision,
    block_sizes=dot_min_group and BlockSizes(dot_min_group=dot_min_group),
  )
  exported = export_cuda(f, *_shapes(8, 16, k, 128, 512, 16, 64, dtype))
  ((verified, triton_ir),) = triton_modules(exported.mlir_module())
  assert verified
  dot_types = r"tt\.dot .*: tensor<(?:\d+x)+(\w+)> \* tensor<(?:\d+x)+(\w+)>"
  found = []
  for line in triton_ir.splitlines():
    if match := re.search(dot_types, line):
      assert match[1] == match[2], line
      # The printer leaves out the default, ieee, which 16-bit operands ignore.
      input_precision = re.search(r"inputPrecision = (\w+)", line)
      ieee = "ieee" if match[1] == "f32" else None
      found.append((match[1], input_precision[1] if input_precision else ieee))
  assert found == dots, triton_ir
  if not dots:  # the broadcast multiply's sums
    assert "tt.reduce" in triton_ir


# (n, h, k, d, p, s, m, dtype, block_sizes, sliding_window): windows within a page, across the
# pages of a compute block and across compute blocks and GPU parts (Gemma 3's 512 and 1,024),
# in 16-bit (dots) and float32 pools, GQA 4 and 1.
WINDOW_LOWERING_CASES = [
  (8, 32, 8, 128, 512, 16, 64, jnp.bfloat16, None, 512),
  (3, 8, 8, 64, 100, 8, 5, jnp.float32, None, 5),
  (16, 64, 8, 128, 2048, 32, 33, jnp.bfloat16, BlockSizes(pages_per_compute_block=4), 1024),
  (4, 16, 8, 128, 640, 16, 136, jnp.bfloat16, None, 100),
]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("n,h,k,d,p,s,m,dtype,block_sizes,window", WINDOW_LOWERING_CASES)
def test_windowed_kernels_lower(platform, n, h, k, d, p, s, m, dtype, block_sizes, window):
  impl = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]
  shapes = _shapes(n, h, k, d, p, s, m, dtype)

  def export(**kwargs):
    f = functools.partial(paged_attention, impl=impl, block_sizes=block_sizes, **kwargs)
    if platform == "cuda":
      return export_cuda(f, *shapes)
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)

  exported = export(sliding_window=window)
  text = exported.mlir_module()
  assert exported.out_avals[0].shape == (n, h, d) and exported.out_avals[0].dtype == dtype
  if platform == "tpu":
    assert "tpu_custom_call" in text
  else:
    assert TRITON_CALL in text
    ((verified, _),) = triton_modules(text)
    assert verified
  assert text != export().mlir_module(), "the window should change the kernel"


# (n, h, k, d, p, s, m, dtype, sliding_window): gpt-oss-20b's attention (64 query heads of 8 kv
# heads, head_dim 64, sinks) in bf16 with and without its 128-token window; GQA 3 in float32
# (the GPU kernel pads the heads and their sinks).
SINK_LOWERING_CASES = [
  (16, 64, 8, 64, 1024, 16, 64, jnp.bfloat16, None),
  (16, 64, 8, 64, 1024, 16, 64, jnp.bfloat16, 128),
  (3, 6, 2, 64, 100, 8, 5, jnp.float32, None),
]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("n,h,k,d,p,s,m,dtype,window", SINK_LOWERING_CASES)
def test_kernels_with_sinks_lower(platform, n, h, k, d, p, s, m, dtype, window):
  impl = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]
  shapes = (*_shapes(n, h, k, d, p, s, m, dtype), jax.ShapeDtypeStruct((h,), jnp.float32))

  def f(*args):
    return paged_attention(*args[:5], sinks=args[5], sliding_window=window, impl=impl)

  if platform == "cuda":
    exported = export_cuda(f, *shapes)
    assert TRITON_CALL in exported.mlir_module()
    ((verified, _),) = triton_modules(exported.mlir_module())
    assert verified
  else:
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()
  assert exported.out_avals[0].shape == (n, h, d) and exported.out_avals[0].dtype == dtype
