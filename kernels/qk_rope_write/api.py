"""The public `qk_rope_write`: input checks and the choice of implementation.

Shapes: n tokens, h query heads, k kv heads, e head dim, f = e // 2, p pages, z page size.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.kernels.common import IMPLS, resolve_impl
from jaxrl.kernels.partitioning import KernelMesh, local_rows, split_call
from jaxrl.kernels.qk_rope_write import reference


def _check_inputs(q, k, v, cos, sin, rows, k_pages, v_pages, q_scale, k_scale) -> None:
  if q.ndim != 3 or k.ndim != 3:
    raise ValueError(
      f"q must be [tokens, q_heads, head_dim] and k, v [tokens, kv_heads, head_dim], got q "
      f"{q.shape} and k {k.shape}."
    )
  n, h, e = q.shape
  if k.shape != v.shape or k.shape[0] != n or k.shape[2] != e:
    raise ValueError(
      f"k and v must both be [tokens={n}, kv_heads, head_dim={e}] like q, got {k.shape} and "
      f"{v.shape}."
    )
  if e % 2:
    raise ValueError(f"The rotary embedding pairs the halves of a head: head_dim {e} is odd.")
  if cos.shape != (n, e // 2) or sin.shape != (n, e // 2):
    raise ValueError(
      f"cos and sin must be [tokens={n}, head_dim // 2={e // 2}], got {cos.shape} and {sin.shape}."
    )
  if rows.shape != (n,) or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise ValueError(f"rows must be an integer [tokens={n}] array, got {rows.dtype}{rows.shape}.")
  if k_pages.ndim != 4 or k_pages.shape[0] != k.shape[1] or k_pages.shape[3] != e:
    raise ValueError(
      f"k_pages must be [kv_heads={k.shape[1]}, pages, page_size, head_dim={e}], got "
      f"{k_pages.shape}."
    )
  if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
    raise ValueError(
      f"v_pages must match k_pages, got {v_pages.dtype}{v_pages.shape} and "
      f"{k_pages.dtype}{k_pages.shape}."
    )
  if (q_scale is None) != (k_scale is None):
    raise ValueError("Give both q_scale and k_scale (q/k norms) or neither.")
  for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
    if scale is not None and scale.shape != (e,):
      raise ValueError(f"{name} must be [head_dim={e}], got {scale.shape}.")


def _gpu_shapes_supported(e: int) -> bool:
  """Triton loads power-of-two sizes: each program loads halves of a head."""
  f = e // 2
  return f >= 1 and f & (f - 1) == 0


@functools.partial(jax.jit, static_argnames=("impl", "eps", "plus_one", "interpret", "kernel_mesh"))
def _run(
  q, k, v, cos, sin, rows, k_pages, v_pages, q_scale, k_scale, *, impl, eps, plus_one, interpret,
  kernel_mesh,
):  # fmt: skip
  cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
  rows = rows.astype(jnp.int32)
  if impl == "reference":
    write = reference.qk_rope_write
  else:
    from jaxrl.kernels.qk_rope_write import pallas_gpu

    write = functools.partial(pallas_gpu.qk_rope_write, interpret=interpret)
  # Split over kv heads as a tensor-parallel engine holds its pools (`kernels.partitioning`).
  # Pools whose pages split over the rows' axes (`KernelMesh.split_pages`) split the tokens
  # with them: each device writes its own rows, whose pages it holds. Pools whole over those
  # axes take every token on every device (each copy must get every token). The reference
  # too: left to XLA, its scatter gathered each layer's new keys and values over the heads'
  # axis (TPU, 4 all-gathers a layer; compiled for a TPU v5e, `launch/bench.py split_kernels`).
  scales = () if q_scale is None else (q_scale, k_scale)
  rule = "n h e, n k e, n k e, n f, n f, n, k p s e, k p s e" + ", e, e" * bool(scales)

  def local(q, k, v, cos, sin, rows, k_pages, v_pages, *scales, page_offset):
    q_scale, k_scale = scales or (None, None)
    rows = local_rows(rows, page_offset, k_pages.shape[1], k_pages.shape[2])
    return write(
      q, k, v, cos, sin, rows, k_pages, v_pages, q_scale_e=q_scale, k_scale_e=k_scale, eps=eps,
      plus_one=plus_one,
    )  # fmt: skip

  split_rows = ("n",) if kernel_mesh is not None and kernel_mesh.split_pages else ()
  return split_call(
    local, rule + " -> n h e, k p s e, k p s e", kernel_mesh,
    q, k, v, cos, sin, rows, k_pages, v_pages, *scales, rows=split_rows, heads=("h", "k"),
    pages=("p",),
  )  # fmt: skip


def qk_rope_write(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  cos: jax.Array,
  sin: jax.Array,
  rows: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  *,
  q_scale: jax.Array | None = None,
  k_scale: jax.Array | None = None,
  eps: float = 1e-6,
  norm_plus_one: bool = False,
  impl: str = "auto",
  interpret: Any = False,
  mesh: KernelMesh | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decode step's q and k normed and rotated, and its k and v written into the pages.

  Token i's query and key heads are RMS-normed over the head dim with `q_scale` / `k_scale`
  (when given: Qwen3's and Gemma 3's q/k norms; `reference.rms_norm`), then rotated by the
  angles whose cosines and sines are `cos[i]` / `sin[i]` (`reference.apply_rope`); its key and
  value, all heads, go to row `rows[i]` = page * page_size + slot of the pools, or nowhere when
  the row is outside `[0, pages * page_size)` (padding). The same numbers as the reference up
  to float32 rounding order (the GPU kernel sums a head's squares in two halves).

  Args:
    q: `[tokens, q_heads, head_dim]`; k, v: `[tokens, kv_heads, head_dim]`, as projected.
    cos, sin: float32 `[tokens, head_dim // 2]`.
    rows: int `[tokens]` destination rows.
    k_pages, v_pages: `[kv_heads, pages, page_size, head_dim]` pools.
    q_scale, k_scale: `[head_dim]` norm scales, both or neither.
    eps: the norms' epsilon.
    norm_plus_one: the norms multiply by `1 + scale` in float32 and then round (Gemma, whose
      scales are stored minus one), where by default they round and then multiply by `scale`
      (Llama and Qwen); `reference.rms_norm`'s `plus_one`.
    impl: `"auto"` (`pallas_gpu` on GPU, `reference` elsewhere: on a TPU or CPU XLA's own
      fusions serve), `"reference"` or `"pallas_gpu"`. The GPU kernel needs head_dim // 2 to
      be a power of two; "auto" runs the reference for other head dims.
    interpret: run the Pallas kernel in interpret mode (on CPU); needs `impl="pallas_gpu"`.
    mesh: where the pools live on a mesh (`KernelMesh`): the kernel then runs on each
      device's kv heads, every token on every device (`jaxrl.kernels.partitioning`).

  Returns:
    (q normed and rotated, in q's dtype; k_pages; v_pages).
  """
  _check_inputs(q, k, v, cos, sin, rows, k_pages, v_pages, q_scale, k_scale)
  if impl == "pallas_tpu":
    raise ValueError(
      "qk_rope_write has no TPU kernel (XLA's TPU fusions serve): use impl='auto' or "
      f"'reference'; impls: {IMPLS}."
    )
  auto = impl == "auto"
  impl = resolve_impl("qk_rope_write", impl, interpret, q)
  if impl == "pallas_tpu":
    impl = "reference"
  if impl == "pallas_gpu" and not _gpu_shapes_supported(q.shape[2]):
    if not auto:
      raise ValueError(
        f"impl='pallas_gpu' needs head_dim // 2 to be a power of two (Triton loads), got "
        f"head_dim {q.shape[2]}; use impl='reference'."
      )
    impl = "reference"
  if q.shape[0] == 0:
    return q, k_pages, v_pages
  return _run(
    q, k, v, cos, sin, rows, k_pages, v_pages, q_scale, k_scale, impl=impl, eps=float(eps),
    plus_one=bool(norm_plus_one), interpret=interpret, kernel_mesh=mesh,
  )  # fmt: skip
