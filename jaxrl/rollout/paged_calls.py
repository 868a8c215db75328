"""The paged engine's device calls: decode windows, prefill chunks, page copies, the KV pool.

Every call declares its input and output shardings, so that the KV pool and the rows' decode
state keep one layout from call to call (an output laid out differently from what the next
call declares would be an error, or a silent copy), and host arrays go straight into the call:
jit's own transfer is about 10x cheaper per array than a separate `device_put`, which was
most of the host time of a small model's decode step.

On a mesh that spans processes (a rollout instance of several processes, each running the same
calls) host inputs become global arrays first, cut from each process's own copy, and the
outputs the host reads (tokens, log-probs, routes) come out replicated (`jaxrl.sharding.hosts`);
on a mesh of one process the calls are the jitted functions themselves.

Glossary: b rows, t tokens per row, n pages per row, k kv heads, p pages, z page size, e head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.compile_ahead import ShapeRecord, shared_function
from jaxrl.kernels.partitioning import KernelMesh, local_page_ids, split_call
from jaxrl.model import ExpertParallel, Model, MoEInputs, PackedPrefillCache, PagedLayerCache
from jaxrl.rollout.decode_loop import DecodeState, RowSampling, WindowOutput, decode_window
from jaxrl.rollout.requests import bucketed_page_pairs
from jaxrl.rollout.sampling import VocabSplit
from jaxrl.sharding import (
  batch_sharding,
  host_array,
  kernel_mesh,
  kv_pool_pspec,
  logical_to_pspec,
  readable,
  to_devices,
)


class PagedCalls:
  """The jitted calls of one paged engine over `mesh` (`config`: its `PagedConfig`).
  `window_pool`: pages of the sliding-window layers' own pool (`window_kv`), whose calls then
  take a second page table (or token pages) for those layers; 0: every layer in the main
  pool, and the second table is None."""

  def __init__(
    self, model: Model, mesh: jax.sharding.Mesh, rules, param_shardings, config, window_pool=0
  ):
    self.model = model
    mc = model.config
    # MoE on a mesh with an expert axis: the expert-parallel layer (else the reference).
    self._moe = MoEInputs(ExpertParallel.for_mesh(mc, mesh))
    # Attention kernels on each device's rows and heads (`jaxrl.kernels.partitioning`), and
    # the pools' pages split with the rows: `page_shards` groups of devices along the rows'
    # axes, each with `config.num_pages` pages (and `window_pool`) of its own rows.
    self._kernel_mesh = kernel_mesh(mesh, rules, split_pages=True)
    rows_axes = self._kernel_mesh.rows if self._kernel_mesh else ()
    self.page_shards = int(np.prod([mesh.shape[a] for a in rows_axes]))
    self.ring_layers = frozenset(mc.sliding_layers if window_pool else ())
    pools = [
      window_pool if i in self.ring_layers else config.num_pages for i in range(mc.num_layers)
    ]
    pools = [pages * self.page_shards for pages in pools]
    dtype = jnp.dtype(mc.dtype)
    kv, makers, self.abstract_kv = [], {}, []  # abstract_kv: the pools' shapes, for compiling
    for pages in pools:
      shape = (mc.num_kv_heads, pages, config.page_size, mc.head_dim)
      spec = kv_pool_pspec(mesh, rules, shape)
      sharding = jax.sharding.NamedSharding(mesh, spec)
      if pages not in makers:
        zeros = shared_function(jnp.zeros, shape, dtype)  # engines of one pool: one trace
        makers[pages] = jax.jit(zeros, out_shardings=sharding)
      kv.append((sharding, sharding))
      pool = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
      self.abstract_kv.append((pool, pool))
    self.new_kv = lambda: [(makers[p](), makers[p]()) for p in pools]
    # The sampler on each device's part of the vocabulary (`sampling.VocabSplit`).
    logits_spec = logical_to_pspec(("batch", "vocab"), rules, mesh)
    self._vocab_split = VocabSplit(mesh, *(_axes(entry) for entry in logits_spec))
    row = self.row_sharding = batch_sharding(mesh, rules, 1)
    matrix = batch_sharding(mesh, rules, 2)
    state, sampling = DecodeState(*[row] * 5), RowSampling(row, row, row, row, matrix)
    self.row_state_shardings = (state, sampling)
    steps_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, row.spec[0]))
    steps_rows, read_row = readable(mesh, steps_rows), readable(mesh, row)
    window = WindowOutput(steps_rows, steps_rows, steps_rows if mc.is_moe else None, read_row)
    self._decode_shardings = (
      (param_shardings, kv, state, sampling, matrix, matrix),
      (window, state, kv),
    )
    self._steps = config.decode_steps
    # What the programs compute with besides their arguments: engines of equal settings in a
    # process share their traces and compiled programs (`shared_function`), and so one count
    # of compiled shapes per program (`_cache_size`): each engine keeps its own (`compiled`).
    self._forward = _Forward(
      model, self._moe, self._kernel_mesh, self.ring_layers, self._vocab_split
    )
    self._shapes = ShapeRecord()
    # Host arrays onto the mesh, and device outputs back (`jaxrl.sharding.hosts`).
    multi = mesh.is_multi_process
    self.put = to_devices if multi else jax.device_put
    self.host = host_array if multi else np.asarray
    self._wrap = _global_inputs if multi else lambda jitted, in_shardings: jitted
    # One jitted decode window per sampler filter width (each compiled per rows and table width).
    self.decoders: dict[int, jax.stages.Wrapped] = {}
    self._decoder_calls: dict[int, jax.stages.Wrapped] = {}
    self._prefill = jax.jit(
      shared_function(_prefill_impl, self._forward),
      donate_argnums=(1,),
      in_shardings=(param_shardings, kv, *[matrix] * 4),
      out_shardings=(kv, read_row if mc.is_moe else None),
    )
    self.prefill = self._counted(
      self._prefill, self._wrap(self._prefill, (None, None, *[matrix] * 4))
    )
    # Packed rows (`prefill.PackedCall`): tokens, positions, segment ids, token pages (the
    # main pool's, the window pool's).
    self._prefill_packed = jax.jit(
      shared_function(_prefill_packed_impl, self._forward),
      donate_argnums=(1,),
      in_shardings=(param_shardings, kv, *[matrix] * 5),
      out_shardings=(kv, read_row if mc.is_moe else None),
    )
    self.prefill_packed = self._counted(
      self._prefill_packed, self._wrap(self._prefill_packed, (None, None, *[matrix] * 5))
    )
    self.num_prefill_tokens = 0  # tokens (positions >= 0) the prefill calls were given
    # Pages of one shard's main pool and window pool (global ids: shard i holds i * n..).
    self._num_pages, self._window_pool = config.num_pages, window_pool
    # Page copies of the main pool's layers, and of the window pool's.
    main_layers = frozenset(range(mc.num_layers)) - self.ring_layers
    self.copy_pages, self.copy_ring_pages = (
      jax.jit(
        shared_function(_copy_pages, layers, self._kernel_mesh),
        donate_argnums=(0,),
        in_shardings=(kv, None, None),
        out_shardings=kv,
      )
      for layers in (main_layers, self.ring_layers)
    )

  @property
  def jitted(self) -> list:
    """Every jitted call made so far (for counting compiled shapes)."""
    return [
      *self.decoders.values(), self._prefill, self._prefill_packed, self.copy_pages,
      self.copy_ring_pages,
    ]  # fmt: skip

  def note(self, jitted, args) -> None:
    """Records that this engine runs (or compiled ahead) `jitted` on `args`, the arguments
    whose shapes vary (after the weights and the KV pool, whose shapes are fixed)."""
    self._shapes.note(jitted, args)

  def compiled(self, jitted=None) -> int:
    """Shapes of `jitted` (None: of every program, the row updates' too) this engine ran or
    compiled ahead: its programs, compiled by it or by an engine of the same settings in the
    process before."""
    return self._shapes.count(jitted)

  def _counted(self, jitted, call):
    """`call` (a prefill: positions are its fourth argument, -1 on padding), counting the
    tokens it computes (what kept and shared pages save shows here) and noting its shapes."""

    def counted(params, kv, tokens_bt, positions_bt, *rest):
      self.num_prefill_tokens += int((positions_bt >= 0).sum())
      self.note(jitted, (tokens_bt, positions_bt, *rest))
      return call(params, kv, tokens_bt, positions_bt, *rest)

    return counted

  def copy(self, kv, pairs: list[tuple[int, int]], ring_pairs: list[tuple[int, int]] = ()):
    """`kv` with the pages of each (source, target) pair of the main pool copied, and of each
    of `ring_pairs` in the window pool (a call per pool that has any; `kv` as it is when
    there are none). Every source is read before any target is written; a pair's pages are
    on one shard (`page_shards`)."""
    for copies, per_shard in ((pairs, self._num_pages), (ring_pairs, self._window_pool)):
      apart = [(s, t) for s, t in copies if s // per_shard != t // per_shard]
      if apart:
        raise ValueError(
          f"Page copies {apart} cross shards of {per_shard} pages: a copy stays on the devices "
          "that hold its pages (a bookkeeping error of the engine; please report it)."
        )
    total = self.page_shards
    if pairs:
      args = bucketed_page_pairs(pairs, self._num_pages * total)
      self.note(self.copy_pages, args)
      kv = self.copy_pages(kv, *args)
    if ring_pairs:
      args = bucketed_page_pairs(list(ring_pairs), self._window_pool * total)
      self.note(self.copy_ring_pages, args)
      kv = self.copy_ring_pages(kv, *args)
    return kv

  def decoder(self, width: int):
    """The jitted window of `decode_steps` decode steps with the sampler's filter `width`:
    (params, kv, DecodeState, RowSampling, page table, the window pool's page table or None)
    -> (WindowOutput, state, kv)."""
    if width not in self.decoders:
      in_shardings, out_shardings = self._decode_shardings
      self.decoders[width] = jax.jit(
        shared_function(_decode_impl, self._forward, self._steps, width),
        donate_argnums=(1,),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
      )
      jitted = self.decoders[width]
      call = self._wrap(jitted, in_shardings)

      def noted(params, kv, *rest, jitted=jitted, call=call):
        self.note(jitted, rest)
        return call(params, kv, *rest)

      self._decoder_calls[width] = noted
    return self._decoder_calls[width]


@dataclasses.dataclass(frozen=True)
class _Forward:
  """The model's forward pass as the engine's programs run it: everything they compute with
  besides their arguments, compared by value (`shared_function`)."""

  model: Model
  moe: MoEInputs
  kernel_mesh: KernelMesh | None
  ring_layers: frozenset[int]  # layers in the window pool, which read the second page table
  vocab_split: VocabSplit

  def __call__(self, params, tokens_bt, positions_bt, layers, **kwargs):
    """(logits, the layers' caches, routes) of `tokens_bt` over the layer caches `layers`."""
    return self.model.apply(
      params, tokens_bt, positions_bt, tuple(layers), return_routing=True, moe=self.moe,
      kernel_mesh=self.kernel_mesh, **kwargs,
    )  # fmt: skip

  def paged(self, kv, table_bn, ring_table_bn):
    """Each layer's paged cache: the window pool's layers read `ring_table_bn`."""
    return tuple(
      PagedLayerCache(k, v, ring_table_bn if i in self.ring_layers else table_bn)
      for i, (k, v) in enumerate(kv)
    )


def _pools(cache) -> list:
  return [(c.k_pages_kpze, c.v_pages_kpze) for c in cache]


def _prefill_impl(forward: _Forward, params, kv, tokens_bt, positions_bt, table_bn, ring_table_bn):
  layers = forward.paged(kv, table_bn, ring_table_bn)
  _, cache, routing_btlk = forward(params, tokens_bt, positions_bt, layers)
  return _pools(cache), routing_btlk


def _prefill_packed_impl(
  forward: _Forward, params, kv, tokens_bt, positions_bt, segment_ids_bt, pages_bt, ring_pages_bt
):
  layers = (
    PackedPrefillCache(k, v, ring_pages_bt if i in forward.ring_layers else pages_bt)
    for i, (k, v) in enumerate(kv)
  )
  _, cache, routing_btlk = forward(
    params, tokens_bt, positions_bt, layers, segment_ids_bt=segment_ids_bt
  )
  return _pools(cache), routing_btlk


def _decode_impl(
  forward: _Forward, steps: int, width: int, params, kv, state, sampling, table_bn, ring_table_bn
):
  def step_logits(kv, tokens_b, positions_b):
    layers = forward.paged(kv, table_bn, ring_table_bn)
    logits_b1v, cache, routing_b1lk = forward(
      params, tokens_b[:, None], positions_b[:, None], layers
    )
    routing_blk = None if routing_b1lk is None else routing_b1lk[:, 0]
    return logits_b1v[:, 0], routing_blk, _pools(cache)

  return decode_window(
    step_logits, kv, state, sampling, steps=steps, filter_width=width,
    vocab_split=forward.vocab_split,
  )  # fmt: skip


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axes."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _global_inputs(jitted, in_shardings):
  """`jitted` for a mesh that spans processes: its host-array arguments (the same on every
  process) made global arrays of their `in_shardings` first, which jit wants there for every
  input that is not replicated."""

  def call(*args):
    return jitted(
      *(
        to_devices(a, s) if isinstance(a, np.ndarray) else a
        for a, s in zip(args, in_shardings, strict=True)
      )
    )

  return call


def _copy_pages(layers: frozenset[int], kernel_mesh, kv, source_c, target_c):
  """The keys and values of pages `source_c` copied into pages `target_c` in the pools of
  `layers` (the others as they are); targets out of range, the padding of a bucketed call,
  write nothing. On each device's kv heads and pages (`kernels.partitioning`): a pair's pages
  are on one device of the rows' axes, which copies it."""

  def move(pages, source_c, target_c, *, page_offset):
    p = pages.shape[1]
    source = local_page_ids(source_c, page_offset, p)
    target = target_c - page_offset
    target = jnp.where((target_c >= 0) & (target >= 0) & (target < p), target, p)
    return pages.at[:, target].set(pages[:, source], mode="drop")

  def copy(pages):
    rule = "k p z e, c, c -> k p z e"
    return split_call(
      move, rule, kernel_mesh, pages, source_c, target_c, heads=("k",), pages=("p",)
    )

  return [(copy(k), copy(v)) if i in layers else (k, v) for i, (k, v) in enumerate(kv)]
