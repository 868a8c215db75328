"""MXFP4, the format of gpt-oss's released expert weights: read into plain floats on load.

OpenAI's gpt-oss checkpoints store each MoE projection as `<name>_blocks` (uint8 `[x, rows,
groups, 16]`: 32 four-bit values a group, two a byte, the low nibble first) and
`<name>_scales` (uint8 `[x, rows, groups]`: one shared power of two a group, biased by 127,
the OCP microscaling E8M0 format). A four-bit value is FP4 E2M1: a sign, then one of 0, 0.5,
1, 1.5, 2, 3, 4, 6. Value j of group g of a row is `fp4[j] * 2 ** (scale[g] - 127)`, and a
row's groups in order are its `groups * 32` columns: a row is an output of the projection and
its columns are the inputs (`[x, out, in]`), transposed here to jaxrl's `[x, in, out]`.

Every such number is exact in bfloat16 (a 2-bit mantissa and the E8M0 exponent range), so
dequantising loses nothing; jaxrl trains and saves the experts in bfloat16 or float32, not
MXFP4 (a saved checkpoint holds `gate_up_proj` and `down_proj` as the unquantised layout that
transformers reads).
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
VALUES_PER_BYTE = 2
GROUP = 32  # values sharing one scale
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`[x, in, out]` in `dtype` from MXFP4 `blocks` (uint8 `[x, out, groups, 16]`) and `scales`
  (uint8 `[x, out, groups]`); one expert converted at a time to bound the float32 buffers."""
  x, rows, groups, group_bytes = blocks.shape
  if scales.shape != (x, rows, groups) or group_bytes * VALUES_PER_BYTE != GROUP:
    raise ValueError(
      f"MXFP4 blocks [experts, rows, groups, {GROUP // VALUES_PER_BYTE}] and scales [experts, "
      f"rows, groups] do not match: {list(blocks.shape)} and {list(scales.shape)}."
    )
  out = np.empty((x, groups * GROUP, rows), dtype)
  for i in range(x):
    values = np.empty((rows, groups, GROUP), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks[i] & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks[i] >> 4]
    exponents = scales[i].astype(np.int32) - SCALE_BIAS
    values = np.ldexp(values, exponents[..., None])
    out[i] = values.reshape(rows, groups * GROUP).T.astype(dtype)
  return out


def quantize(w_xio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(blocks, scales) of `[x, in, out]` weights, each group's scale the smallest power of two
  that keeps its largest value within FP4's 6 and each value rounded to the nearest FP4 value:
  what a checkpoint in this format holds (for tests and for writing one; jaxrl saves unquantised
  weights)."""
  x, cols, rows = w_xio.shape
  if cols % GROUP:
    raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {cols}.")
  w_xrgj = np.swapaxes(np.asarray(w_xio, np.float32), 1, 2).reshape(x, rows, cols // GROUP, GROUP)
  top = np.max(np.abs(w_xrgj), axis=-1)
  exponents = np.ceil(np.log2(np.where(top > 0, top, 1.0) / 6.0)).astype(np.int32)
  exponents = np.clip(exponents, -SCALE_BIAS, 255 - SCALE_BIAS)
  scaled = w_xrgj / np.ldexp(np.float32(1.0), exponents)[..., None]
  codes = np.argmin(np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]), axis=-1).astype(np.uint8)
  codes |= np.where(np.signbit(scaled), np.uint8(8), np.uint8(0))
  blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  # Contiguous: safetensors writers take the bytes as laid out.
  return np.ascontiguousarray(blocks), np.ascontiguousarray(exponents + SCALE_BIAS, np.uint8)
