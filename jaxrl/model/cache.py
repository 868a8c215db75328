"""KV caches and the attention that reads them: none (training), dense slots, or pages.

Every path writes the new keys/values first and then attends, with visibility decided by
positions (key position <= query position; in a sliding-window layer also key position >
query position - window). Stale cache contents beyond a row's current
position are therefore never read, and a ragged batch needs no extra mask. Without a cache
(training), rows may be packed with several sequences: segment ids then also restrict a query
to the keys of its own sequence (`jaxrl.train.packing`).

Glossary: b batch, t query positions, s key slots, k kv heads, g query heads per kv head,
e head dim, p pages, z page size (slots per page), n pages per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.kernels.common import softcap
from jaxrl.kernels.flash_attention import flash_attention
from jaxrl.kernels.paged_attention import paged_attention
from jaxrl.kernels.partitioning import KernelMesh, local_page_ids, local_rows, split_call
from jaxrl.kernels.qk_rope_write import qk_rope_write, write_rows


class LayerCache(NamedTuple):
  """Dense cache of one layer: keys and values for every slot of every row, [b, s, k, e]."""

  k_bske: jax.Array
  v_bske: jax.Array


class PagedLayerCache(NamedTuple):
  """Paged cache of one layer plus the page table of the rows in this call.

  Attributes:
    k_pages_kpze: keys, [kv heads, pages, page size, head dim]; shared by all sequences.
    v_pages_kpze: values, same shape.
    page_table_bn: page ids of each row's sequence in order; token at position i of row b
      lives in page page_table_bn[b, i // page_size], slot i % page_size.
  """

  k_pages_kpze: jax.Array
  v_pages_kpze: jax.Array
  page_table_bn: jax.Array


class PackedPrefillCache(NamedTuple):
  """Paged cache of one layer for a packed prefill call: each row holds the tokens of several
  sequences from position 0 on, told apart by segment ids (the rows of `jaxrl.train.packing`),
  so a call's attention needs no page table, only the row's own keys; each token's keys go to
  the page of its own sequence.

  Attributes:
    k_pages_kpze, v_pages_kpze: as in `PagedLayerCache`.
    token_pages_bt: the page each token is written to (slot: its position % page size); the
      number of pages (out of range) for padding, which writes nothing.
  """

  k_pages_kpze: jax.Array
  v_pages_kpze: jax.Array
  token_pages_bt: jax.Array


@dataclasses.dataclass(frozen=True)
class PackedPrefillKeys:
  """A packed prefill's layer inside the scan over the blocks (`ModelConfig.scan_layers`):
  attention reads the row's own keys and values, as with a `PackedPrefillCache`, and they
  come back as the layer's "cache", in `dtype` (the pool's), for `write_packed_prefill` to
  write after the scan (a scan's body cannot index the layers' separate pools)."""

  dtype: Any


def init_cache(cfg, batch: int, max_len: int) -> tuple[LayerCache, ...]:
  """An empty (zeroed) dense KV cache with `max_len` slots per row."""
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = jnp.dtype(cfg.dtype)
  return tuple(
    LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)
  )


def dot_attention(
  q_bthe,
  keys_bske,
  values_bske,
  q_pos_bt,
  key_pos_bs,
  q_segment_ids_bt=None,
  key_segment_ids_bs=None,
  sliding_window: int | None = None,
  logit_softcap: float | None = None,
  sinks: jax.Array | None = None,
):
  """Grouped-query softmax attention (fp32 softmax); a key is visible iff its position <= the
  query's, with a `sliding_window` also > the query's minus the window, and, when segment ids
  are given (packed rows), it has the query's segment id and that id is not negative
  (padding). A query that sees no key outputs zeros. `logit_softcap` c: logits `s` become
  `c * tanh(s / c)` before the mask (Gemma 2). `sinks` (`[h]`, gpt-oss): each query head's
  softmax has one more logit, its sink, whose value is zero.

  The rule of `jaxrl.kernels.flash_attention`, so the kernel computes the same attention."""
  b, t, h, e = q_bthe.shape
  k = keys_bske.shape[2]
  dt = q_bthe.dtype
  q_btkge = q_bthe.reshape(b, t, k, h // k, e)
  scores = jnp.einsum("btkge,bske->bkgts", q_btkge, keys_bske.astype(dt)).astype(jnp.float32)
  scores = scores * (e**-0.5)
  scores = softcap(scores, logit_softcap)
  visible_bts = key_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
  if sliding_window is not None:
    visible_bts &= key_pos_bs[:, None, :] > q_pos_bt[:, :, None] - sliding_window
  if q_segment_ids_bt is not None:
    key_segment_b1s = key_segment_ids_bs[:, None, :]
    visible_bts &= (key_segment_b1s == q_segment_ids_bt[:, :, None]) & (key_segment_b1s >= 0)
  scores = jnp.where(visible_bts[:, None, None], scores, -1e30)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  else:  # the sink as one more logit of the softmax, dropped from the weights
    sink_kg11 = sinks.astype(jnp.float32).reshape(k, h // k, 1, 1)
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink_kg11)
    weights = jnp.exp(scores - top)
    denom = jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink_kg11 - top)
    probs = (weights / denom).astype(dt)
  out_btkge = jnp.einsum("bkgts,bske->btkge", probs, values_bske.astype(dt))
  if q_segment_ids_bt is not None:  # padding queries see nothing: zeros, not a uniform mean
    out_btkge = jnp.where(visible_bts.any(-1)[:, :, None, None, None], out_btkge, 0)
  return out_btkge.reshape(b, t, h, e)


class LogitRule(NamedTuple):
  """A layer's options of its attention logits: the sliding window (None: every earlier
  position) and the softcap (None: none), static, and its attention sinks (an `[h]` array;
  None: none). Their names are the keyword arguments of `dot_attention`, `flash_attention`
  and `paged_attention`."""

  sliding_window: int | None = None
  logit_softcap: float | None = None
  sinks: jax.Array | None = None


# `ModelConfig.attention` -> `flash_attention`'s impl ("dense" is `dot_attention`).
FLASH_IMPL = {"flash": "auto", "cudnn": "cudnn"}


def attend(
  q_bthe, k_btke, v_btke, positions_bt, cache, segment_ids_bt=None, attention: str = "dense",
  sliding_window: int | None = None, logit_softcap: float | None = None, sinks=None,
  kernel_mesh: KernelMesh | None = None,
):  # fmt: skip
  """Writes this call's keys/values into `cache` (if any) and attends; returns (out, cache).
  `sliding_window`: the layer's window (static), None for full causal attention;
  `logit_softcap`: the attention logits' cap (static, `dot_attention`), None for none;
  `sinks`: the layer's attention sinks (`[h]`, `dot_attention`), None for none.
  With a paged cache, `paged_attention` reads the pages.

  `segment_ids_bt` (no cache only): packed rows, where a token attends to the earlier (or
  equal) positions of its own segment; `positions_bt` then restart at 0 in every segment.
  `attention` (`ModelConfig.attention`; no cache only): "dense" (`dot_attention`), or "flash"
  or "cudnn", `flash_attention` through the kernel of the platform or cuDNN: the same rule.
  `kernel_mesh`: where the operands live on a mesh, so that the kernels run on each device's
  rows and heads (`jaxrl.kernels.partitioning`); None on one device."""
  rule = LogitRule(sliding_window, logit_softcap, sinks)
  if cache is None:
    if attention in FLASH_IMPL:
      out = flash_attention(
        q_bthe, k_btke, v_btke,
        q_segment_ids=segment_ids_bt, kv_segment_ids=segment_ids_bt,
        q_positions=positions_bt, kv_positions=positions_bt, impl=FLASH_IMPL[attention],
        mesh=kernel_mesh, **rule._asdict(),
      )  # fmt: skip
      return out, None
    out = dot_attention(
      q_bthe, k_btke, v_btke, positions_bt, positions_bt, segment_ids_bt, segment_ids_bt,
      **rule._asdict(),
    )  # fmt: skip
    return out, None
  if isinstance(cache, (PackedPrefillCache, PackedPrefillKeys)):
    if segment_ids_bt is None:
      raise ValueError("A packed prefill (PackedPrefillCache) needs segment_ids_bt.")
    return _attend_packed_prefill(
      q_bthe, k_btke, v_btke, positions_bt, cache, segment_ids_bt, attention, rule, kernel_mesh
    )
  if segment_ids_bt is not None:
    raise ValueError(
      "segment_ids_bt (packed rows) are for the forward pass without a KV cache (training) or "
      "with a PackedPrefillCache; a dense or paged cache attends by positions alone: pass "
      "segment_ids_bt=None."
    )
  if isinstance(cache, LayerCache):
    return _attend_dense(q_bthe, k_btke, v_btke, positions_bt, cache, rule)
  return _attend_paged(q_bthe, k_btke, v_btke, positions_bt, cache, rule, kernel_mesh)


def _attend_dense(q_bthe, k_btke, v_btke, positions_bt, cache: LayerCache, rule: LogitRule):
  # Each row writes at its own positions (ragged batch).
  rows_b1 = jnp.arange(q_bthe.shape[0])[:, None]
  keys = cache.k_bske.at[rows_b1, positions_bt].set(k_btke.astype(cache.k_bske.dtype))
  values = cache.v_bske.at[rows_b1, positions_bt].set(v_btke.astype(cache.v_bske.dtype))
  key_pos_bs = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
  out = dot_attention(q_bthe, keys, values, positions_bt, key_pos_bs, **rule._asdict())
  return out, LayerCache(keys, values)


def _attend_packed_prefill(
  q_bthe, k_btke, v_btke, positions_bt, cache, segment_ids_bt, attention, rule: LogitRule,
  kernel_mesh,
):  # fmt: skip
  """Every sequence of a packed row starts at position 0 here: its keys are all in the row, so
  attention reads them from the row (cast to the cache's dtype first, as a chunked prefill
  reads them back from the pages) and the pages are only written: here, or after the scan
  over the blocks (`PackedPrefillKeys`: the keys and values are returned instead)."""
  scanned = isinstance(cache, PackedPrefillKeys)
  dtype = cache.dtype if scanned else cache.k_pages_kpze.dtype
  keys_btke, values_btke = k_btke.astype(dtype), v_btke.astype(dtype)
  out, _ = attend(
    q_bthe, keys_btke, values_btke, positions_bt, None, segment_ids_bt, attention, *rule,
    kernel_mesh,
  )  # fmt: skip
  if scanned:
    return out, (keys_btke, values_btke)
  return out, write_packed_prefill(cache, keys_btke, values_btke, positions_bt, kernel_mesh)


def write_packed_prefill(
  cache: PackedPrefillCache, keys_btke, values_btke, positions_bt, kernel_mesh=None
) -> PackedPrefillCache:
  """`cache` with a packed prefill's keys and values (in its dtype) at each token's page
  (`token_pages_bt`) and slot (its position % page size); padding (position < 0) writes
  nothing."""
  num_pages, page_size = cache.k_pages_kpze.shape[1:3]
  slot_bt = jnp.maximum(positions_bt, 0) % page_size
  page_bt = jnp.where(positions_bt >= 0, cache.token_pages_bt, num_pages)
  k_pages = write_pages(cache.k_pages_kpze, keys_btke, page_bt, slot_bt, kernel_mesh)
  v_pages = write_pages(cache.v_pages_kpze, values_btke, page_bt, slot_bt, kernel_mesh)
  return PackedPrefillCache(k_pages, v_pages, cache.token_pages_bt)


def write_pages(pages_kpze, new_btke, page_bt, slot_bt, kernel_mesh=None):
  """The pool with each token's keys (or values), all heads, at its page and slot; a token
  whose page is outside the pool writes nothing (`write_rows`: one scatter of whole rows).
  With a `kernel_mesh`, each device writes its own kv heads of every token: left to XLA, the
  scatter gathered the new keys and values over the heads' axis (a tensor-parallel packed
  prefill: 3 all-gathers every 4 layers compiled for H100s, 19 for a TPU v5e). A pool whose
  pages split over the rows' axes (`KernelMesh.split_pages`) takes each row's tokens on the
  devices of its row, which hold its pages (the engine lays its calls' rows out so)."""
  rows_bt = _rows(page_bt, slot_bt, pages_kpze.shape[1], pages_kpze.shape[2])

  def write_local(pages_kpze, new_btke, rows_bt, *, page_offset):
    rows_n = local_rows(rows_bt.reshape(-1), page_offset, *pages_kpze.shape[1:3])
    return write_rows(pages_kpze, new_btke, rows_n)

  split_rows = ("b",) if kernel_mesh is not None and kernel_mesh.split_pages else ()
  return split_call(
    write_local, "k p z e, b t k e, b t -> k p z e", kernel_mesh, pages_kpze, new_btke, rows_bt,
    rows=split_rows, heads=("k",), pages=("p",),
  )  # fmt: skip


def gather_pages(k_pages_kpze, v_pages_kpze, page_table_bn, kernel_mesh=None):
  """Each row's keys and values in order, `[b, n * z, k, e]` each, from the pages its table
  lists (a prefill chunk attends to them densely). On each device's rows and kv heads with a
  `kernel_mesh`, as the attention kernels (`jaxrl.kernels.partitioning`): left to XLA, a
  gather from pools split over the rows' axes could gather the pools."""

  def gather(k_pages, v_pages, table_bn, *, page_offset):
    table_bn = local_page_ids(table_bn, page_offset, k_pages.shape[1])
    b, n = table_bn.shape
    flat = lambda pages: jnp.moveaxis(pages[:, table_bn], 0, -2).reshape(  # noqa: E731
      b, n * pages.shape[2], -1, pages.shape[-1]
    )
    return flat(k_pages), flat(v_pages)

  return split_call(
    gather, "k p z e, k p z e, b n -> b s k e, b s k e", kernel_mesh, k_pages_kpze,
    v_pages_kpze, page_table_bn, rows=("b",), heads=("k",), pages=("p",),
  )  # fmt: skip


def _rows(page_bt, slot_bt, num_pages, page_size):
  """Rows of the pool seen as `[pages * page_size]` slots per head (shaped as `page_bt`); -1
  where the page is outside the pool (nothing written)."""
  inside = (page_bt >= 0) & (page_bt < num_pages)
  return jnp.where(inside, page_bt * page_size + slot_bt, -1)


def _token_pages(positions_bt, cache: PagedLayerCache):
  """The page and slot of each token of a paged call; padding (position < 0) gets page
  `num_pages`, out of range, so that its write is dropped."""
  num_pages, page_size = cache.k_pages_kpze.shape[1:3]
  safe_pos_bt = jnp.maximum(positions_bt, 0)
  page_bt = jnp.take_along_axis(cache.page_table_bn, safe_pos_bt // page_size, axis=1)
  return jnp.where(positions_bt >= 0, page_bt, num_pages), safe_pos_bt % page_size


def _read_paged_decode(
  q_bthe, k_pages, v_pages, positions_bt, page_table_bn, rule: LogitRule, kernel_mesh
):  # fmt: skip
  """Decode attention, one query per row, read straight from the pages (this step's keys and
  values already written)."""
  lengths_b = jnp.where(positions_bt[:, 0] >= 0, positions_bt[:, 0] + 1, 0).astype(jnp.int32)
  table_bn = page_table_bn.astype(jnp.int32)
  out = paged_attention(
    q_bthe[:, 0], k_pages, v_pages, lengths_b, table_bn, mesh=kernel_mesh, **rule._asdict()
  )
  return out[:, None]


def attend_paged_decode(
  q_bthe, k_btke, v_btke, positions_bt, cache: PagedLayerCache, cos_btf, sin_btf, q_scale=None,
  k_scale=None, *, eps, norm_plus_one: bool = False, sliding_window: int | None = None,
  logit_softcap: float | None = None, sinks=None, kernel_mesh: KernelMesh | None = None,
):  # fmt: skip
  """A decode step (t = 1) against a paged cache, from the projections: q and k RMS-normed
  (with `q_scale`/`k_scale`, when given; `norm_plus_one` as `rms_norm`'s `plus_one`) and
  rotated, k and v written into the pages (`qk_rope_write`: one kernel on a GPU, where XLA
  makes five), then paged attention.
  The same as norms, `apply_rope` and `attend`. Returns (out, cache)."""
  num_pages, page_size = cache.k_pages_kpze.shape[1:3]
  rows_b = _rows(*_token_pages(positions_bt, cache), num_pages, page_size).reshape(-1)
  q_bhe, k_pages, v_pages = qk_rope_write(
    q_bthe[:, 0], k_btke[:, 0], v_btke[:, 0], cos_btf[:, 0], sin_btf[:, 0], rows_b,
    cache.k_pages_kpze, cache.v_pages_kpze, q_scale=q_scale, k_scale=k_scale, eps=eps,
    norm_plus_one=norm_plus_one, mesh=kernel_mesh,
  )  # fmt: skip
  out = _read_paged_decode(
    q_bhe[:, None], k_pages, v_pages, positions_bt, cache.page_table_bn,
    LogitRule(sliding_window, logit_softcap, sinks), kernel_mesh,
  )  # fmt: skip
  return out, PagedLayerCache(k_pages, v_pages, cache.page_table_bn)


def _attend_paged(
  q_bthe, k_btke, v_btke, positions_bt, cache: PagedLayerCache, rule: LogitRule, kernel_mesh
):  # fmt: skip
  """Positions < 0 mark padding tokens: they write nothing and their outputs are ignored."""
  page_size = cache.k_pages_kpze.shape[2]
  page_bt, slot_bt = _token_pages(positions_bt, cache)
  k_pages = write_pages(cache.k_pages_kpze, k_btke, page_bt, slot_bt, kernel_mesh)
  v_pages = write_pages(cache.v_pages_kpze, v_btke, page_bt, slot_bt, kernel_mesh)
  new_cache = PagedLayerCache(k_pages, v_pages, cache.page_table_bn)
  if q_bthe.shape[1] == 1:
    out = _read_paged_decode(
      q_bthe, k_pages, v_pages, positions_bt, cache.page_table_bn, rule, kernel_mesh
    )
    return out, new_cache
  # Prefill chunk: gather each row's pages into contiguous slots and attend densely.
  b, n = cache.page_table_bn.shape
  keys, values = gather_pages(k_pages, v_pages, cache.page_table_bn, kernel_mesh)
  key_pos_bs = jnp.broadcast_to(jnp.arange(n * page_size), (b, n * page_size))
  out = dot_attention(q_bthe, keys, values, positions_bt, key_pos_bs, **rule._asdict())
  return out, new_cache
