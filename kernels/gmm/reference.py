"""Grouped matmuls in pure jnp: the definition, the CPU path and the kernels' oracle.

Both are `jax.lax.ragged_dot_general`, which XLA lowers on every platform; rows at or past
`sum(group_sizes)` take part in nothing, and the float32 matmuls run at full precision.

Shapes: m rows, k contraction dim, n output columns, g groups.
"""

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def _ragged(lhs, rhs, group_sizes_g, dot_dims, rhs_group_dims, out_dtype):
  dims = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=dot_dims,
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=rhs_group_dims,
  )
  out = lax.ragged_dot_general(
    lhs, rhs, group_sizes_g, dims, precision=_HIGHEST, preferred_element_type=jnp.float32
  )
  return out.astype(out_dtype)


def gmm(
  lhs_mk: jax.Array,
  rhs_gkn: jax.Array,
  group_sizes_g: jax.Array,
  *,
  transpose_rhs: bool = False,
  out_dtype: jnp.dtype,
) -> jax.Array:
  """`out[r] = lhs[r] @ rhs[group of r]`, zeros for rows past the groups.

  Args:
    lhs_mk: rows sorted by group.
    rhs_gkn: one `[k, n]` matrix per group, or `[n, k]` with `transpose_rhs`.
    group_sizes_g: int32 rows per group, non-negative and summing to at most m.
    transpose_rhs: use `rhs[g].T` (the backward pass's `grad @ rhs.T` without a copy).
    out_dtype: dtype of the result; the products accumulate in float32.

  Returns:
    `[m, n]` in `out_dtype`.
  """
  contract_rhs = 2 if transpose_rhs else 1
  return _ragged(
    lhs_mk, rhs_gkn, group_sizes_g, (((1,), (contract_rhs,)), ((), ())), [0], out_dtype
  )


def tgmm(
  lhs_mk: jax.Array, grad_mn: jax.Array, group_sizes_g: jax.Array, *, out_dtype: jnp.dtype
) -> jax.Array:
  """`out[g] = lhs[rows of g].T @ grad[rows of g]`, zeros for empty groups.

  Args:
    lhs_mk: rows sorted by group.
    grad_mn: rows sorted by group, like `lhs_mk`.
    group_sizes_g: int32 rows per group, non-negative and summing to at most m.
    out_dtype: dtype of the result; the products accumulate in float32.

  Returns:
    `[g, k, n]` in `out_dtype`.
  """
  return _ragged(lhs_mk, grad_mn, group_sizes_g, (((0,), (0,)), ((), ())), [], out_dtype)
