"""Kernels run on each device's rows and heads: `KernelMesh` and `split_call`.

A Pallas kernel reaches XLA as a custom call that XLA's partitioner cannot look into.

- On a GPU, it makes every operand whole on every device and runs the kernel on all of it
  there. Compiled for H100s without them (2026-11-29, `launch/bench.py split_kernels`):
  - a tensor-parallel rollout engine (Qwen3-8B over 2 GPUs) all-gathered both KV pools of
    every layer at every decode step, for paged attention and again for `qk_rope_write`
    (all-gathers of 19.4 GB a step on each GPU), and each GPU attended with every head;
  - a learner on an fsdp mesh gathered the whole batch's q, k and v around flash attention,
    and each GPU computed every row's attention, forward and backward.
- On a TPU, it refuses: "Mosaic kernels cannot be automatically partitioned. Please wrap the
  call in a shard_map." So no multi-chip program with a kernel in it compiled.
  (`custom_partitioning`, the other way to tell the partitioner, does not reach the TPU
  compiler: jax-ml/jax#38196.)

So a kernel call runs inside a `jax.shard_map` over the caller's mesh (`KernelMesh`): its
operands split over their rows (the mesh axes a batch's sequences are split over) and their
kv heads (those the weights' heads are split over), as the engine and the learner hold them.
Every other dimension is whole on each device: sequence positions, pages, head dims. A kernel
computes each row and kv head from that row and head alone, so each device runs it on its own
pieces and nothing crosses devices. On one device, without a `KernelMesh`, or inside a
`shard_map` that already made the mesh's axes manual, the kernel is called as it is; on a mesh
where neither rows nor heads split (an expert axis alone), each device runs it on whole
operands, as XLA did on GPUs, but now in a `shard_map`, which a TPU needs.

A rollout engine over several devices of its rows' axes (`data`) splits its KV pools' pages
over them too (`KernelMesh.split_pages`): device i holds the pages of the rows on device i, so
that the engine's capacity grows with its devices instead of every device holding, and writing,
every page. Page ids stay global (the host's allocator hands device i the ids of its own range);
a kernel that takes `pages=` factors gets `page_offset`, the id of its device's first page, and
reads its rows' pages at `id - page_offset`. Reads (page tables) need every row's pages on the
row's own device; writes of tokens not split with the pages (a packed prefill's) are dropped on
the devices that do not hold their page.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl.kernels.common import traced_setting

_UNSPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar("unsplit_kernels", default=False)


@dataclasses.dataclass(frozen=True)
class KernelMesh:
  """Where a kernel call's operands live: `mesh`, the axes that split a batch's rows
  (sequences) and those that split its kv heads (`jaxrl.sharding.kernel_mesh` builds it from
  a stage's rules). Hashable: kernels take it as a static argument."""

  mesh: jax.sharding.Mesh
  rows: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  # The KV pools' pages split over the `rows` axes, as the rows are (module docstring).
  split_pages: bool = False


def unsplit_kernels():
  """Traces inside call the kernels whole, as before `split_call` (one custom call that the
  partitioner gathers onto every device): for measuring what the split saves in the same
  process (`launch/bench.py split_kernels`)."""
  return traced_setting(_UNSPLIT, True)


def _factors(spec: str) -> list[tuple[str, ...]]:
  """ "b k e, b n" -> [("b", "k", "e"), ("b", "n")]."""
  return [tuple(part.split()) for part in spec.split(",")]


def _factor_axes(kernel_mesh: KernelMesh, operands, args, rows, heads) -> dict:
  """{factor: mesh axes} for the factors of `rows` and of `heads`, each group kept only where
  every dimension of its factors divides among its axes of more than one device."""
  sizes = dict(kernel_mesh.mesh.shape)
  out = {}
  for factors, names in ((rows, kernel_mesh.rows), (heads, kernel_mesh.heads)):
    names = tuple(a for a in names if sizes.get(a, 1) > 1)
    pairs = list(zip(operands, args, strict=True))
    dims = [arg.shape[fs.index(f)] for f in factors for fs, arg in pairs if f in fs]
    if names and dims and all(d % math.prod(sizes[a] for a in names) == 0 for d in dims):
      out.update(dict.fromkeys(factors, names))
  return out


def _spec(factors: tuple[str, ...], axes: dict) -> PartitionSpec:
  entries = [axes.get(f) for f in factors]
  return PartitionSpec(*[e[0] if e and len(e) == 1 else e for e in entries])


def split_call(
  fn: Callable, rule: str, kernel_mesh: KernelMesh | None, *args, rows: Sequence[str] = (),
  heads: Sequence[str] = (), pages: Sequence[str] = (),
):  # fmt: skip
  """`fn(*args)` on each device's rows and kv heads (module docstring). `rule` names each
  dimension of each operand and result with a factor, einsum style ("n h d, k p s d -> n h
  d"); the factors of `rows` are split over `kernel_mesh.rows` and those of `heads` over
  `kernel_mesh.heads`, all others whole. Query heads (h) and kv heads (k) split in equal
  blocks go together: device i's kv heads are those its query heads attend with, where the
  axes' size divides k. `fn` must compute each row and head from its own pieces: no sum
  across rows or heads. Results: one array, or a tuple for several.

  `pages`: the factors of a KV pool's page axis. `fn` is then called with `page_offset=`,
  the global id of the first page its device holds (0 where the pages are whole); with
  `kernel_mesh.split_pages` they split over the rows' axes, and the `rows` factors must split
  with them (a row reads its pages on its own device)."""
  operands_spec, results_spec = rule.split("->")
  operands, results = _factors(operands_spec), _factors(results_spec)
  if len(operands) != len(args):
    raise ValueError(f"split_call: rule {rule!r} names {len(operands)} operands, got {len(args)}.")
  for factors, arg in zip(operands, args, strict=True):
    if len(factors) != arg.ndim:
      raise ValueError(
        f"split_call: rule {rule!r} gives {factors} for an operand of shape {arg.shape}."
      )
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if kernel_mesh is None or kernel_mesh.mesh.size == 1 or manual or _UNSPLIT.get():
    return fn(*args, page_offset=0) if pages else fn(*args)
  # Where nothing splits (a mesh of expert axes alone, rows that do not divide) the kernel
  # still runs in a shard_map, on whole operands: a TPU compiles no kernel outside one.
  axes = _factor_axes(kernel_mesh, operands, args, rows, heads)
  if pages:
    fn = _with_page_offset(fn, kernel_mesh, operands, args, rows, pages, axes)
  out_specs = [_spec(fs, axes) for fs in results]
  mapped = jax.shard_map(
    fn,
    mesh=kernel_mesh.mesh,
    in_specs=tuple(_spec(fs, axes) for fs in operands),
    out_specs=out_specs[0] if len(results) == 1 else tuple(out_specs),
    # The kernels' outputs do not say which axes they vary over (`output_like`); each is
    # per-device by construction, as its out_specs say.
    check_vma=False,
  )
  return mapped(*args)


def local_page_ids(page_ids, page_offset, num_pages: int):
  """Global page ids (a page table) as ids into this device's `num_pages` pages, which start
  at global id `page_offset` (`split_call`'s). Ids of other devices' pages (a table's unused
  entries, a padding row's) are clipped into range: a kernel must not load outside its pool,
  and what it reads there is masked by the row's length. Unchanged where the pages are whole
  (`page_offset` the constant 0): programs on one device stay as they were."""
  if isinstance(page_offset, int) and page_offset == 0:
    return page_ids
  return jnp.clip(page_ids - page_offset, 0, num_pages - 1)


def local_rows(rows, page_offset, num_pages: int, page_size: int):
  """A pool's global rows (`page * page_size + slot`, -1: write nothing) as rows of this
  device's `num_pages` pages, which start at global page `page_offset`; -1 where the page is
  another device's (its write is dropped here: that device makes it). Unchanged where the
  pages are whole (`page_offset` the constant 0): the writers drop rows outside the pool."""
  if isinstance(page_offset, int) and page_offset == 0:
    return rows
  local = rows - page_offset * page_size
  return jnp.where((rows >= 0) & (local >= 0) & (local < num_pages * page_size), local, -1)


def _with_page_offset(fn, kernel_mesh, operands, args, rows, pages, axes):
  """`fn` given its device's `page_offset`; `axes` gets the `pages` factors' mesh axes when
  the pools' pages split (`KernelMesh.split_pages`), checked against the rows'."""
  split = tuple(a for a in kernel_mesh.rows if kernel_mesh.mesh.shape[a] > 1)
  if not (kernel_mesh.split_pages and split):
    return functools.partial(fn, page_offset=0)
  shards = math.prod(kernel_mesh.mesh.shape[a] for a in split)
  pool = next((fs, arg) for fs, arg in zip(operands, args, strict=True) if pages[0] in fs)
  num_pages = pool[1].shape[pool[0].index(pages[0])]
  if num_pages % shards:
    raise ValueError(
      f"split_call: a KV pool of {num_pages} pages does not split over the {shards} devices "
      f"of its rows' axes {split}; size the pool in multiples of {shards}."
    )
  unsplit = [f for f in rows if any(f in fs for fs in operands) and axes.get(f) != split]
  if unsplit:
    raise ValueError(
      f"split_call: the rows ({unsplit}) of a call that reads pages split over {split} do not "
      f"split over those axes (not a multiple of {shards} rows?): each row's pages are on its "
      "own device only."
    )
  axes.update(dict.fromkeys(pages, split))
  local = num_pages // shards

  def with_offset(*a):
    return fn(*a, page_offset=jax.lax.axis_index(split) * local)

  return with_offset
