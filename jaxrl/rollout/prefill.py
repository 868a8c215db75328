"""Prefill plans: the arrays of the paged engine's prefill calls for a set of admitted requests.

A request's prefill caches every token but its last (`paged`'s invariant). Two kinds of call:

- packed: rows of `width` tokens, each holding whole sequences of several requests from
  position 0 on, told apart by segment ids; ragged prompts cost their own length, not the
  longest one's (a 20-token and a 100-token prompt share a 128-token row). Attention reads the
  row's own keys, each token's keys go to its own request's pages (`PackedPrefillCache`).
- chunked: one request per row, `width` positions at a time, attending over the row's page
  table: for sequences longer than one packed row, and for those whose first positions are
  cached already (a multi-turn turn reusing its last turn's pages), which attend to them.

`prefill_admitted` runs them for the engine's admitted requests.

Glossary: b rows, t tokens per row.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxrl.rollout.engine import bucket
from jaxrl.rollout.requests import record_prompt_routing
from jaxrl.rollout.window_kv import ring_pages

if TYPE_CHECKING:
  from jaxrl.rollout.admission import Running
  from jaxrl.rollout.paged import PagedEngine


@dataclasses.dataclass(frozen=True)
class Segment:
  """Sequence `index` of the plan occupies row `row`, tokens `offset : offset + length`."""

  index: int
  row: int
  offset: int
  length: int


@dataclasses.dataclass(frozen=True)
class PackedCall:
  """One packed prefill call: tokens, positions (-1 padding), segment ids (-1 padding) and the
  page each token is written to (`num_pages` for padding), [b, t] each; `segments` says where
  each sequence went; `ring_token_pages_bt`: the pages of the window pool (`window_kv`), None
  without one."""

  tokens_bt: np.ndarray
  positions_bt: np.ndarray
  segment_ids_bt: np.ndarray
  token_pages_bt: np.ndarray
  segments: tuple[Segment, ...]
  ring_token_pages_bt: np.ndarray | None = None


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
  """Indices of `lengths` (each in 1..width) packed into rows of `width` tokens, first fit in
  decreasing length order (at most 11/9 of the fewest rows, plus one); longest first in a row."""
  if any(n < 1 or n > width for n in lengths):
    raise ValueError(f"pack_rows: every length must be in 1..{width}, got {sorted(lengths)}.")
  rows: list[list[int]] = []
  free: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    row = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
    if row is None:
      rows.append([])
      free.append(width)
      row = len(rows) - 1
    rows[row].append(i)
    free[row] -= lengths[i]
  return rows


def packed_call(
  seqs: Sequence[Sequence[int]],
  pages: Sequence[Sequence[int]],
  *,
  rows: int,
  width: int,
  page_size: int,
  num_pages: int,
  pad_id: int,
  layout: list[list[int]] | None = None,
  rings: Sequence[Sequence[int]] | None = None,
  window_pages: int = 0,
) -> PackedCall:
  """The packed call that caches every token but the last of each of `seqs` (request i's
  pages: `pages[i]`), in `rows` rows of `width` tokens (at least what `pack_rows` needs);
  `layout`: `pack_rows`'s answer for these sequences, if the caller has it already; `rings`:
  each request's ring in the window pool of `window_pages` pages, if the engine has one."""
  lengths = [len(x) - 1 for x in seqs]
  layout = pack_rows(lengths, width) if layout is None else layout
  if len(layout) > rows:
    raise ValueError(f"packed_call: {len(layout)} rows needed, {rows} given.")
  tokens = np.full((rows, width), pad_id, np.int32)
  positions = np.full((rows, width), -1, np.int32)
  segment_ids = np.full((rows, width), -1, np.int32)
  token_pages = np.full((rows, width), num_pages, np.int32)
  ring_token_pages = None if rings is None else np.full((rows, width), window_pages, np.int32)
  segments = []
  for row, members in enumerate(layout):
    offset = 0
    for segment, i in enumerate(members):
      n = lengths[i]
      span = slice(offset, offset + n)
      tokens[row, span] = seqs[i][:n]
      positions[row, span] = np.arange(n)
      segment_ids[row, span] = segment
      token_pages[row, span] = np.asarray(pages[i], np.int32)[np.arange(n) // page_size]
      if rings is not None:
        ring_token_pages[row, span] = ring_pages(rings[i], np.arange(n) // page_size)
      segments.append(Segment(i, row, offset, n))
      offset += n
  return PackedCall(tokens, positions, segment_ids, token_pages, tuple(segments), ring_token_pages)


def chunk_spans(
  lengths: Sequence[int],
  chunk: int,
  row_cap: Callable[[int], int] | None = None,
  shards: Sequence[int] | None = None,
) -> Iterator[tuple[int, int, list[int]]]:
  """(start, stop, indices) of each chunked call: positions start..stop-1 of the sequences
  (indices into `lengths`, tokens to cache) still running past `start`, at most
  `row_cap(stop - start)` of them a call (default: all), or with `shards` (sequence i's is
  `shards[i]`) at most that many of each shard's."""
  longest = max(lengths, default=0)
  for start in range(0, longest, chunk):
    stop = min(start + chunk, longest)
    live = [i for i, n in enumerate(lengths) if start < n]
    cap = row_cap(stop - start) if row_cap else max(len(live), 1)
    groups = collections.defaultdict(list)
    for i in live:
      groups[shards[i] if shards is not None else 0].append(i)
    calls = max(-(-len(g) // cap) for g in groups.values())
    for call in range(calls):
      yield start, stop, [i for g in groups.values() for i in g[call * cap : (call + 1) * cap]]


def chunk_rows(
  seqs: Sequence[Sequence[int] | None],
  start: int,
  stop: int,
  shape: tuple[int, int],
  pad_id: int,
  offsets: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Tokens and positions (-1: padding) of a chunked call of `shape` [b, t]: positions
  offset+start..offset+stop-1 of each of `seqs` (one to a row, None: a padding row; each
  caches every token but its last). `offsets[i]`: the positions of sequence i already cached
  (kept pages of an earlier turn, `kv_park`), which the chunks skip; default none."""
  tokens = np.full(shape, pad_id, np.int32)
  positions = np.full(shape, -1, np.int32)
  for row, x in enumerate(seqs):
    if x is None:
      continue
    first = start + (offsets[row] if offsets is not None else 0)
    part = x[first : min(first + stop - start, len(x) - 1)]
    tokens[row, : len(part)] = part
    positions[row, : len(part)] = np.arange(first, first + len(part))
  return tokens, positions


def record_packed_routing(records, call: PackedCall, routing_btlk: np.ndarray) -> None:
  """MoE: records each request's prompt routes from a packed call (`records[i]`: sequence i)."""
  for seg in call.segments:
    span = routing_btlk[seg.row : seg.row + 1, seg.offset : seg.offset + seg.length]
    record_prompt_routing([records[seg.index]], 0, span)


def prefill_admitted(engine: PagedEngine, states: Sequence[Running], starts: Sequence[int]):
  """Caches every token but the last of each admitted request from position `starts[i]` on
  (those before are in kept pages): sequences from 0 that fit one `prefill_chunk` packed into
  shared rows (`pack_prefill`), the others chunk by chunk over their page tables. A part of
  `PagedEngine`, apart for the module's length: it updates the engine's KV pool."""
  cfg = engine.cfg
  seqs = [s.record.prompt_ids + s.record.token_ids for s in states]
  fits = [
    cfg.pack_prefill and not a and 1 < len(x) <= cfg.prefill_chunk + 1
    for x, a in zip(seqs, starts, strict=True)
  ]
  packed = [i for i, f in enumerate(fits) if f]
  if packed:
    _prefill_packed(engine, [states[i] for i in packed], [seqs[i] for i in packed])
  rest = [(s, x, a) for s, x, a, f in zip(states, seqs, starts, fits, strict=True) if not f]
  lengths = [len(x) - 1 - a for _, x, a in rest]
  calls = engine._calls
  cap = lambda n: engine._chunk_row_cap(engine._chunk_width(n))  # noqa: E731
  shards = [s.shard for s, _, _ in rest]
  for start, stop, live in chunk_spans(lengths, cfg.prefill_chunk, cap, shards):
    # Each row on its shard's devices, which hold its pages (`PagedEngine._block_order`).
    order = [
      None if j is None else live[j] for j in engine._block_order([rest[i][0] for i in live])
    ]
    layout = [None if i is None else rest[i][0] for i in order]
    shape = len(layout), engine._chunk_width(stop - start)
    offsets = [0 if i is None else rest[i][2] for i in order]
    seqs_live = [None if i is None else rest[i][1] for i in order]
    tokens, positions = chunk_rows(seqs_live, start, stop, shape, engine.pad_id, offsets)
    tables = engine._page_tables(layout, len(tokens))
    engine._kv, routing_btlk = calls.prefill(engine.params, engine._kv, tokens, positions, *tables)
    if routing_btlk is not None:
      routing_btlk = calls.host(routing_btlk)
      for row, i in enumerate(order):
        if i is not None:  # columns past the chunk's tokens are padding (width is bucketed)
          span = routing_btlk[row : row + 1, : stop - start]
          record_prompt_routing([rest[i][0].record], offsets[row] + start, span)


def _prefill_packed(engine: PagedEngine, states: Sequence[Running], seqs: Sequence[list[int]]):
  cfg, calls = engine.cfg, engine._calls
  width = engine._chunk_width(max(len(x) - 1 for x in seqs))
  # Each shard's sequences packed into rows of its own devices, which hold their pages (one
  # shard on one device: all of them); packed once, sized from it.
  layouts = []
  for shard in range(engine.shards):
    members = [i for i, s in enumerate(states) if s.shard == shard]
    packed = pack_rows([len(seqs[i]) - 1 for i in members], width) if members else []
    layouts.append([[members[i] for i in row] for row in packed])
  cap = engine._chunk_row_cap(width)  # calls of at most `prefill_tokens`
  rings = [s.ring for s in states] if engine.ring_pages else None
  window_pages = engine.ring_allocator.num_pages if engine.ring_pages else 0
  for first in range(0, max(len(x) for x in layouts), cap):
    blocks = [layout[first : first + cap] for layout in layouts]
    block = bucket(max(len(b) for b in blocks), 1)
    rows = [row for b in blocks for row in b + [[]] * (block - len(b))]  # []: a padding row
    call = packed_call(
      seqs, [s.pages for s in states], rows=len(rows), width=width, page_size=cfg.page_size,
      num_pages=engine.allocator.num_pages, pad_id=engine.pad_id, layout=rows, rings=rings,
      window_pages=window_pages,
    )  # fmt: skip
    engine._kv, routing_btlk = calls.prefill_packed(
      engine.params, engine._kv, call.tokens_bt, call.positions_bt, call.segment_ids_bt,
      call.token_pages_bt, call.ring_token_pages_bt,
    )  # fmt: skip
    if routing_btlk is not None:
      record_packed_routing([s.record for s in states], call, calls.host(routing_btlk))
