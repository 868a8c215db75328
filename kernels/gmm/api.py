"""The public `gmm` and `tgmm`: input checks, block sizes, gradients, the choice of kernel.

Shapes: m rows, k contraction dim, n output columns, g groups.
"""

import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.common import check_block_fields, resolve_impl
from jaxrl.kernels.gmm import reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the grouped-matmul kernels; a field left as None is derived from the shapes.

  Values larger than the (padded) dimension they tile are clipped to it.

  Attributes:
    tm: rows of lhs per tile. A tile may hold rows of several groups; it is visited once per
      group it holds. TPU: a multiple of 8 (16 for 16-bit dtypes) or the whole m. GPU: a power
      of two >= 16.
    tk: contraction (k) elements per step. TPU: a multiple of 128 or the whole k. GPU: a power
      of two >= 16.
    tn: output columns per tile. TPU: a multiple of 128 or the whole n. GPU: a power of two
      >= 16.
    num_warps: GPU only: Triton warps per program, a power of two.
    num_stages: GPU only: Triton software-pipelining stages.
  """

  tm: int | None = None
  tk: int | None = None
  tn: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    check_block_fields(self)


def _load_tpu() -> ModuleType:
  from jaxrl.kernels.gmm import pallas_tpu

  return pallas_tpu


def _load_gpu() -> ModuleType:
  from jaxrl.kernels.gmm import pallas_gpu

  return pallas_gpu


# Kernels load lazily, so that a CPU-only install never imports a backend it cannot use. Each
# module has `gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, block_sizes, interpret)`
# and `tgmm(lhs, grad, group_sizes, *, out_dtype, block_sizes, interpret)`.
_LOADERS: dict[str, Callable[[], ModuleType]] = {
  "reference": lambda: reference,
  "pallas_tpu": _load_tpu,
  "pallas_gpu": _load_gpu,
}


def _check_group_sizes(group_sizes, num_groups: int, m: int) -> None:
  """Shape and dtype always; values only when concrete (under tracing they are unknown)."""
  if group_sizes.ndim != 1 or group_sizes.shape[0] != num_groups:
    raise ValueError(
      f"group_sizes must be 1-D with one entry per group, [num_groups={num_groups}], got shape "
      f"{group_sizes.shape}."
    )
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer (int32) array, got {group_sizes.dtype}.")
  if isinstance(group_sizes, jax.core.Tracer):
    return
  sizes = np.asarray(group_sizes).astype(np.int64)
  if np.any(sizes < 0):
    raise ValueError(f"group_sizes must be non-negative, got {sizes.tolist()}.")
  total = int(sizes.sum())
  if total > m:
    raise ValueError(
      f"group_sizes sum to {total} but lhs has only m={m} rows: the groups must fit in lhs. "
      "Lower group_sizes or give lhs more rows (rows past the groups are ignored)."
    )


def _check_floats(**arrays) -> None:
  for name, x in arrays.items():
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {x.dtype}.")
  (name_a, a), (name_b, b) = arrays.items()
  if a.dtype != b.dtype:
    raise ValueError(
      f"{name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype}; cast one "
      "(preferred_element_type sets the output dtype)."
    )


def _out_dtype(preferred_element_type, default) -> jnp.dtype:
  if preferred_element_type is None:
    return jnp.dtype(default)
  dtype = jnp.dtype(preferred_element_type)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"preferred_element_type must be a floating dtype, got {dtype}.")
  return dtype


def _resolve_impl(op: str, impl: str, block_sizes, interpret, x: jax.Array) -> str:
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes)}.")
  return resolve_impl(op, impl, interpret, x)


def _clean_group_sizes(group_sizes_g: jax.Array, m: int) -> jax.Array:
  """Negative sizes become 0 and the groups are cut at row m, as ragged_dot does.

  Only matters under tracing (concrete values were checked); every implementation then sees
  groups that lie inside lhs, so no kernel reads or writes out of bounds.
  """
  ends_g = jnp.clip(jnp.cumsum(jnp.maximum(group_sizes_g.astype(jnp.int32), 0)), 0, m)
  return jnp.diff(ends_g, prepend=0).astype(jnp.int32)


# Static configuration shared by forward and backward: (impl, block_sizes, interpret).


def _gmm_call(cfg, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
  impl, block_sizes, interpret = cfg
  module = _LOADERS[impl]()
  if impl == "reference":
    return module.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
  return module.gmm(
    lhs,
    rhs,
    group_sizes,
    transpose_rhs=transpose_rhs,
    out_dtype=out_dtype,
    block_sizes=block_sizes,
    interpret=interpret,
  )


def _tgmm_call(cfg, lhs, grad, group_sizes, *, out_dtype):
  impl, block_sizes, interpret = cfg
  module = _LOADERS[impl]()
  if impl == "reference":
    return module.tgmm(lhs, grad, group_sizes, out_dtype=out_dtype)
  return module.tgmm(
    lhs, grad, group_sizes, out_dtype=out_dtype, block_sizes=block_sizes, interpret=interpret
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs_mk, rhs_gkn, group_sizes_g, cfg, out_dtype):
  return _gmm_call(cfg, lhs_mk, rhs_gkn, group_sizes_g, transpose_rhs=False, out_dtype=out_dtype)


def _gmm_fwd(lhs_mk, rhs_gkn, group_sizes_g, cfg, out_dtype):
  out_mn = _gmm(lhs_mk, rhs_gkn, group_sizes_g, cfg, out_dtype)
  return out_mn, (lhs_mk, rhs_gkn, group_sizes_g)


def _gmm_bwd(cfg, out_dtype, residuals, grad_mn):
  del out_dtype
  lhs_mk, rhs_gkn, group_sizes_g = residuals
  # The kernels take operands of one dtype: a float32 cotangent of a bf16 gmm (with
  # preferred_element_type=float32) is rounded to bf16, as a bf16 backward pass would be.
  grad_mn = grad_mn.astype(lhs_mk.dtype)
  dlhs_mk = _gmm_call(
    cfg, grad_mn, rhs_gkn, group_sizes_g, transpose_rhs=True, out_dtype=lhs_mk.dtype
  )
  drhs_gkn = _tgmm_call(cfg, lhs_mk, grad_mn, group_sizes_g, out_dtype=rhs_gkn.dtype)
  return dlhs_mk, drhs_gkn, None  # integer group sizes get no cotangent


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tgmm(lhs_mk, grad_mn, group_sizes_g, cfg, out_dtype):
  return _tgmm_call(cfg, lhs_mk, grad_mn, group_sizes_g, out_dtype=out_dtype)


def _tgmm_fwd(lhs_mk, grad_mn, group_sizes_g, cfg, out_dtype):
  out_gkn = _tgmm(lhs_mk, grad_mn, group_sizes_g, cfg, out_dtype)
  return out_gkn, (lhs_mk, grad_mn, group_sizes_g)


def _tgmm_bwd(cfg, out_dtype, residuals, cot_gkn):
  del out_dtype
  lhs_mk, grad_mn, group_sizes_g = residuals
  cot_gkn = cot_gkn.astype(lhs_mk.dtype)
  # out[g] = lhs_g.T @ grad_g, so d lhs_g = grad_g @ cot[g].T and d grad_g = lhs_g @ cot[g].
  dlhs_mk = _gmm_call(
    cfg, grad_mn, cot_gkn, group_sizes_g, transpose_rhs=True, out_dtype=lhs_mk.dtype
  )
  dgrad_mn = _gmm_call(
    cfg, lhs_mk, cot_gkn, group_sizes_g, transpose_rhs=False, out_dtype=grad_mn.dtype
  )
  return dlhs_mk, dgrad_mn, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype"))
def _run_gmm(lhs_mk, rhs_gkn, group_sizes_g, *, cfg, out_dtype):
  group_sizes_g = _clean_group_sizes(group_sizes_g, lhs_mk.shape[0])
  return _gmm(lhs_mk, rhs_gkn, group_sizes_g, cfg, out_dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype"))
def _run_tgmm(lhs_mk, grad_mn, group_sizes_g, *, cfg, out_dtype):
  group_sizes_g = _clean_group_sizes(group_sizes_g, lhs_mk.shape[0])
  return _tgmm(lhs_mk, grad_mn, group_sizes_g, cfg, out_dtype)


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  impl: str = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
  preferred_element_type: Any = None,
) -> jax.Array:
  """Grouped matmul: `out[r] = lhs[r] @ rhs[g]` for each row r of group g.

  The semantics of `jax.lax.ragged_dot(lhs, rhs, group_sizes)`: the rows of lhs are sorted
  by group, rows `0 .. group_sizes[0] - 1` belong to group 0, the next `group_sizes[1]` to
  group 1, and so on; rows at or past `sum(group_sizes)` give zeros. Products accumulate in
  float32. Differentiable in lhs and rhs with every impl (a `custom_vjp` whose backward pass
  is this impl's `gmm` with rhs transposed, for lhs, and `tgmm`, for rhs; rows past the
  groups get zero gradient). With a `preferred_element_type` wider than the inputs, the
  backward pass rounds the incoming cotangent to the inputs' dtype.

  Args:
    lhs: `[m, k]` rows sorted by group.
    rhs: `[num_groups, k, n]` one matrix per group, same dtype as lhs.
    group_sizes: int32 `[num_groups]` rows per group. Concrete values are checked: negative
      sizes or a sum past m raise. Under tracing they cannot be: negative sizes count as 0 and
      groups are cut at row m (rows past m are simply not produced), as ragged_dot does.
    impl: `"auto"` (`pallas_tpu` on TPU, `pallas_gpu` on GPU, `reference` elsewhere, from the
      platform of lhs's devices, or of the default backend while tracing), `"reference"`,
      `"pallas_tpu"` or `"pallas_gpu"`.
    block_sizes: kernel tiling, None for defaults derived from the shapes.
    interpret: run the Pallas kernel in interpret mode (on CPU). True, or for `pallas_tpu` a
      `pltpu.InterpretParams`; it needs a kernel `impl`, since the reference has no kernel.
    preferred_element_type: output dtype, default lhs's dtype.

  Returns:
    `[m, n]` in `preferred_element_type` (default lhs's dtype).

  Raises:
    ValueError: unknown `impl`, wrong ranks, shapes or dtypes, group sizes that are negative
      or sum past m (when concrete), `interpret` without a kernel, or block sizes the chosen
      kernel cannot use.
  """
  impl = _resolve_impl("gmm", impl, block_sizes, interpret, lhs)
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [m, k], got shape {lhs.shape}.")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be [num_groups, k, n], got shape {rhs.shape}.")
  m, k = lhs.shape
  num_groups, k_rhs, n = rhs.shape
  if k_rhs != k:
    raise ValueError(
      f"lhs is [m, k={k}] but rhs is [num_groups, k={k_rhs}, n]: the contraction dims differ."
    )
  _check_floats(lhs=lhs, rhs=rhs)
  group_sizes = jnp.asarray(group_sizes)
  _check_group_sizes(group_sizes, num_groups, m)
  out_dtype = _out_dtype(preferred_element_type, lhs.dtype)
  if min(m, k, n, num_groups) == 0:
    return jnp.zeros((m, n), out_dtype)
  cfg = (impl, block_sizes, interpret)
  return _run_gmm(lhs, rhs, group_sizes, cfg=cfg, out_dtype=out_dtype)


def tgmm(
  lhs: jax.Array,
  grad: jax.Array,
  group_sizes: jax.Array,
  *,
  impl: str = "auto",
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
  preferred_element_type: Any = None,
) -> jax.Array:
  """Transposed grouped matmul, gmm's weight gradient: `out[g] = lhs[rows of g].T @ grad[...]`.

  Groups are laid out as in `gmm`; rows at or past `sum(group_sizes)` are ignored and empty
  groups give zeros. Products accumulate in float32. Differentiable in lhs and grad with every
  impl (a `custom_vjp` made of this impl's `gmm`).

  Args:
    lhs: `[m, k]` rows sorted by group.
    grad: `[m, n]` rows sorted by group, same dtype as lhs.
    group_sizes: int32 `[num_groups]` rows per group; checked and clipped as in `gmm`.
    impl: as in `gmm`.
    block_sizes: kernel tiling, None for defaults derived from the shapes.
    interpret: as in `gmm`.
    preferred_element_type: output dtype, default lhs's dtype.

  Returns:
    `[num_groups, k, n]` in `preferred_element_type` (default lhs's dtype).

  Raises:
    ValueError: as in `gmm`.
  """
  impl = _resolve_impl("tgmm", impl, block_sizes, interpret, lhs)
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [m, k], got shape {lhs.shape}.")
  if grad.ndim != 2:
    raise ValueError(f"grad must be [m, n], got shape {grad.shape}.")
  m, k = lhs.shape
  if grad.shape[0] != m:
    raise ValueError(
      f"lhs is [m={m}, k] but grad is [m={grad.shape[0]}, n]: they must have the same rows."
    )
  n = grad.shape[1]
  _check_floats(lhs=lhs, grad=grad)
  group_sizes = jnp.asarray(group_sizes)
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes must be 1-D, [num_groups], got shape {group_sizes.shape}.")
  num_groups = group_sizes.shape[0]
  _check_group_sizes(group_sizes, num_groups, m)
  out_dtype = _out_dtype(preferred_element_type, lhs.dtype)
  if min(m, k, n, num_groups) == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)
  cfg = (impl, block_sizes, interpret)
  return _run_tgmm(lhs, grad, group_sizes, cfg=cfg, out_dtype=out_dtype)
