"""Flash attention lowered for the platforms a CPU machine does not have: the TPU kernels
through Mosaic, the GPU kernels for CUDA (the Triton calls, their Triton IR's dots, and the
launch settings of each pass), with and without a sliding window and a logit softcap.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, e head dim.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers.lowering import export_cuda, triton_modules

from jaxrl.kernels.flash_attention import BlockSizes, flash_attention


def _shapes(b, t, s, h, k, e, dtype):
  sds = jax.ShapeDtypeStruct
  ids = (
    sds((b, t), jnp.int32),
    sds((b, s), jnp.int32),
    sds((b, t), jnp.int32),
    sds((b, s), jnp.int32),
  )
  return (sds((b, t, h, e), dtype), sds((b, s, k, e), dtype), sds((b, s, k, e), dtype), *ids)


def _fwd_and_grad(impl, block_sizes, sliding_window=None, logit_softcap=None):
  def fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    return flash_attention(
      q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
      kv_positions=kv_pos, impl=impl, block_sizes=block_sizes, sliding_window=sliding_window,
      logit_softcap=logit_softcap,
    )  # fmt: skip

  def grad(q, k, v, *ids):
    loss = lambda q, k, v: jnp.sum(fwd(q, k, v, *ids).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return fwd, grad


# (b, t, s, h, k, e, dtype, block_sizes): Qwen3-0.6B heads (16 q, 8 kv, 128) on a 1000-token
# packed row, and a prefill chunk of 256 after 768 cached tokens with GQA 4 and head_dim 64.
LOWERING_CASES = [
  (2, 1000, 1000, 16, 8, 128, jnp.bfloat16, None),
  (1, 256, 1024, 8, 2, 64, jnp.float32, "small"),
]
SMALL_BLOCKS = {
  "pallas_tpu": BlockSizes(block_q=128, block_kv=256, block_q_bwd=64, block_kv_bwd=128),
  "pallas_gpu": BlockSizes(
    block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=32, num_warps=4, block_q_dq=64
  ),
}


@pytest.mark.parametrize("b,t,s,h,k,e,dtype,blocks", LOWERING_CASES)
def test_tpu_kernels_lower_for_tpu(b, t, s, h, k, e, dtype, blocks):
  fwd, grad = _fwd_and_grad("pallas_tpu", SMALL_BLOCKS["pallas_tpu"] if blocks else None)
  args = _shapes(b, t, s, h, k, e, dtype)
  exported = jax.export.export(jax.jit(fwd), platforms=["tpu"])(*args)
  assert exported.mlir_module().count("tpu_custom_call") == 1
  assert exported.out_avals[0].shape == (b, t, h, e) and exported.out_avals[0].dtype == dtype
  text = jax.export.export(jax.jit(grad), platforms=["tpu"])(*args).mlir_module()
  assert text.count("tpu_custom_call") == 3  # forward (recomputed for the residuals), dq, dk/dv


@pytest.mark.parametrize("b,t,s,h,k,e,dtype,blocks", LOWERING_CASES)
def test_gpu_kernels_lower_for_cuda(b, t, s, h, k, e, dtype, blocks):
  fwd, grad = _fwd_and_grad("pallas_gpu", SMALL_BLOCKS["pallas_gpu"] if blocks else None)
  args = _shapes(b, t, s, h, k, e, dtype)
  exported = export_cuda(fwd, *args)
  assert exported.out_avals[0].shape == (b, t, h, e) and exported.out_avals[0].dtype == dtype
  modules = triton_modules(export_cuda(grad, *args).mlir_module())
  assert len(modules) == 3  # forward, dq, dk/dv
  for verified, triton_ir in modules:
    assert verified and "tt.dot" in triton_ir


def _kernel_code(impl: str, text: str) -> list[str]:
  """The code of each kernel in an exported module: each Triton module's IR (verified), or
  each Mosaic kernel's serialized body."""
  if impl == "pallas_gpu":
    modules = triton_modules(text)
    assert all(verified and "tt.dot" in ir for verified, ir in modules)
    return [ir for _, ir in modules]
  return re.findall(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)", text)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_sliding_window_kernels_lower(impl):
  """Gemma 3's local layers (a 512-position window) on packed rows of 1000 tokens with
  Qwen3-0.6B's heads: the forward, dq and dk/dv kernels lower, each with the window inside it
  (its code differs from the windowless kernel's)."""
  args = _shapes(2, 1000, 1000, 16, 8, 128, jnp.bfloat16)
  kernels = {}
  for window in (None, 512):
    grad = jax.jit(_fwd_and_grad(impl, None, sliding_window=window)[1])
    if impl == "pallas_gpu":
      exported = export_cuda(grad, *args)
    else:
      exported = jax.export.export(grad, platforms=["tpu"])(*args)
    assert [x.shape for x in exported.out_avals] == [x.shape for x in args[:3]]
    kernels[window] = _kernel_code(impl, exported.mlir_module())
  assert len(kernels[None]) == len(kernels[512]) == 3  # forward, dq, dk/dv
  for plain, windowed in zip(kernels[None], kernels[512], strict=True):
    assert plain != windowed


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_logit_softcap_kernels_lower(impl):
  """Gemma 2's attention (its 8 query and 4 kv heads of 256, logits capped at 50.0; every other
  layer with a 4096-position window) on packed rows of 1000 tokens, bf16 and float32: the
  forward, dq and dk/dv kernels lower with the cap, with and without the window, each with the
  cap inside it (its code differs from the uncapped kernel's; in the Triton IR, libdevice's
  tanhf, which the uncapped kernels never call)."""
  for dtype in (jnp.bfloat16, jnp.float32):
    args = _shapes(2, 1000, 1000, 8, 4, 256, dtype)
    kernels = {}
    for window, cap in ((None, None), (None, 50.0), (4096, 50.0)):
      grad = jax.jit(_fwd_and_grad(impl, None, sliding_window=window, logit_softcap=cap)[1])
      if impl == "pallas_gpu":
        exported = export_cuda(grad, *args)
      else:
        exported = jax.export.export(grad, platforms=["tpu"])(*args)
      assert [x.shape for x in exported.out_avals] == [x.shape for x in args[:3]]
      kernels[window, cap] = _kernel_code(impl, exported.mlir_module())
    plain = kernels[None, None]
    for capped in (kernels[None, 50.0], kernels[4096, 50.0]):
      assert len(plain) == len(capped) == 3  # forward, dq, dk/dv
      assert all(a != b for a, b in zip(plain, capped, strict=True))
      if impl == "pallas_gpu":
        assert all("__nv_tanhf" in code for code in capped)
        assert not any("__nv_tanhf" in code for code in plain)


def _triton_dots(dtype) -> list[list[tuple[str, str]]]:
  """(operand type, input precision) of each tt.dot in each Triton kernel of the gradient."""
  _, grad = _fwd_and_grad("pallas_gpu", None)
  text = export_cuda(grad, *_shapes(1, 256, 256, 4, 2, 64, dtype)).mlir_module()
  kernels = []
  for verified, triton_ir in triton_modules(text):
    assert verified
    dots = []
    for line in triton_ir.splitlines():
      if match := re.search(r"tt\.dot .*: tensor<(?:\d+x)+(\w+)> \*", line):
        precision = re.search(r"inputPrecision = (\w+)", line)
        # The printer leaves out the default, ieee.
        dots.append((match[1], precision[1] if precision else "ieee"))
    kernels.append(dots)
  return kernels


def test_gpu_float32_dots_are_split_tf32_on_tensor_cores():
  """Float32 inputs: every product is three TF32 tensor-core dots (3xTF32), none an IEEE dot on
  CUDA cores (which spilled tens of KB a thread, compiled for an H100); bf16 inputs: one
  bf16 dot a product."""
  f32, bf16 = _triton_dots(jnp.float32), _triton_dots(jnp.bfloat16)
  assert len(f32) == len(bf16) == 3  # forward, dq, dk/dv
  for split, plain in zip(f32, bf16, strict=True):
    assert plain and all(operand == "bf16" for operand, _ in plain), plain
    assert split and all(dot == ("f32", "tf32") for dot in split), split
    assert len(split) == 3 * len(plain)


def test_gpu_backward_takes_its_own_warps_and_stages():
  """`num_warps_bwd` / `num_stages_bwd` reach the dq and dk/dv Triton calls, the forward keeps
  `num_warps` / `num_stages`, and the backward defaults to the forward's."""

  def launch_settings(block_sizes):
    _, grad = _fwd_and_grad("pallas_gpu", block_sizes)
    text = export_cuda(grad, *_shapes(1, 256, 256, 4, 2, 64, jnp.bfloat16)).mlir_module()
    pattern = r'name = "(flash_attention_\w+)", num_stages = (\d+) : i32, num_warps = (\d+)'
    found = re.findall(pattern, text)
    return {name: (int(stages), int(warps)) for name, stages, warps in found}

  assert launch_settings(BlockSizes(num_warps=4, num_warps_bwd=8, num_stages_bwd=3)) == {
    "flash_attention_fwd_gpu": (2, 4),
    "flash_attention_dq_gpu": (3, 8),
    "flash_attention_dkv_gpu": (3, 8),
  }
  assert set(launch_settings(BlockSizes(num_warps=4, num_stages=3)).values()) == {(3, 4)}
