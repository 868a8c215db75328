"""Split-precision float32 dots for the Triton (Pallas GPU) kernels: "3xTF32".

Triton multiplies float32 operands either on CUDA cores at full IEEE precision (`ieee`: a
multiply-add per product, several times slower than tensor cores, and in a large tile an
unrolled loop that spills) or on tensor cores in TF32 (10 mantissa bits, about 1e-3 relative).
Splitting each float32 operand into a TF32 high part and a TF32 residual and summing three
tensor-core dots (hi*hi + lo*hi + hi*lo; the dropped lo*lo is below 2**-22 of the product) keeps
each product within 3 * 2**-22 of exact (about 12 float32 rounding units) at tensor-core speed.

On a CPU (interpret mode) a float32 dot at `Precision.DEFAULT` is exact on TF32 values, so the
split's own error is what the interpreted kernels show.
"""

import jax
import jax.numpy as jnp

IEEE = jax.lax.Precision.HIGHEST  # Triton `inputPrecision = ieee` for float32 operands
# Triton `inputPrecision = tf32`; on a CPU (interpret mode) a float32 dot, exact on TF32 values.
TF32 = jax.lax.Precision.DEFAULT
# TF32 parts per float32 operand of a dot, by precision; 0: the operands as they are (IEEE).
TF32_PARTS = {
  jax.lax.Precision.DEFAULT: 1,
  jax.lax.Precision.HIGH: 2,
  jax.lax.Precision.HIGHEST: 0,
}


def round_to_tf32(x_f32):
  """The nearest TF32 value (ties away from zero), as float32 with the low 13 bits clear."""
  bits = jax.lax.bitcast_convert_type(x_f32, jnp.int32)
  bits = (bits + 0x1000) & -0x2000
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def tf32_parts(x, parts: int) -> tuple[jax.Array, ...]:
  """`x` as the sum of `parts` TF32 values (hi, then lo), or as itself for parts=0."""
  if parts == 0:
    return (x,)
  hi = round_to_tf32(x)
  return (hi,) if parts == 1 else (hi, round_to_tf32(x - hi))


def split_dot(a_parts, b_parts, contract, parts: int):
  """a @ b in float32 from `tf32_parts` of both (`contract`: dot_general's contracting dims):
  hi*hi, plus lo*hi + hi*lo for 2 parts; one IEEE dot for parts=0."""

  def dot(a, b):
    return jax.lax.dot_general(
      a,
      b,
      (contract, ((), ())),
      precision=IEEE if parts == 0 else TF32,
      preferred_element_type=jnp.float32,
    )

  out = dot(a_parts[0], b_parts[0])
  if parts == 2:
    out = (dot(a_parts[1], b_parts[0]) + dot(a_parts[0], b_parts[1])) + out
  return out
