"""`PagedEngine.precompile`: every decode window, prefill call and page copy an engine can make,
run once on padding rows (position -1: they read and write no cache), so that none compiles
mid-run. The row updates between windows (`decode_loop.DeviceBatch`) are not covered: they are
small programs that compile in well under a second."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxrl.rollout.decode_loop import dead_rows
from jaxrl.rollout.engine import bucket
from jaxrl.rollout.requests import pages_for

if TYPE_CHECKING:
  from jaxrl.rollout.paged import PagedEngine


def precompile_engine(
  engine: PagedEngine,
  stop_widths: Sequence[int],
  filter_widths: Sequence[int],
  max_tokens: int | None,
) -> int:
  """Runs each shape of `engine` once (arguments: `PagedEngine.precompile`'s); returns how
  many. A part of `PagedEngine`, apart for the module's length: it uses the engine's calls and
  shape rules (`_rows`, `_table_width`, `_chunk_width`) and updates its KV cache."""
  cfg, mc = engine.cfg, engine.model.config
  calls, params, kv, pad = engine._calls, engine.params, engine._kv, engine.pad_id
  max_tokens = max_tokens or (cfg.max_tokens if cfg.max_tokens > 0 else mc.max_seq_len)
  max_tokens = min(max_tokens, mc.max_seq_len)
  row_counts = sorted({engine._rows(n) for n in range(1, cfg.max_running + 1)})
  max_pages = pages_for(max_tokens, cfg.page_size)
  widths = sorted({engine._table_width(p) for p in range(1, max_pages + 1)})
  # Prefill caches every token but the last: chunks of up to `max_tokens - 1`.
  longest_chunk = max(1, min(cfg.prefill_chunk, max_tokens - 1))
  chunks = sorted({engine._chunk_width(c) for c in range(1, longest_chunk + 1)})
  # Packed, sequences of up to `prefill_chunk + 1` tokens meet the chunked call only as a
  # next turn's tokens after its kept pages (`keep_turn_kv`).
  chunked = not cfg.pack_prefill or cfg.keep_turn_kv or max_tokens > cfg.prefill_chunk + 1
  shapes = 0
  try:
    for rows, width in itertools.product(row_counts, widths):
      table = np.zeros((rows, width), np.int32)
      for stops, filters in itertools.product(stop_widths, filter_widths):
        state, sampling = calls.put(dead_rows(rows, stops, pad), calls.row_state_shardings)
        *_, kv = calls.decoder(filters)(params, kv, state, sampling, table)
        shapes += 1
      for chunk in chunks if chunked else ():
        tokens = np.full((rows, chunk), pad, np.int32)
        positions = np.full((rows, chunk), -1, np.int32)
        kv, _ = calls.prefill(params, kv, tokens, positions, table)
        shapes += 1
    for rows, chunk in itertools.product(row_counts, chunks if cfg.pack_prefill else ()):
      tokens = np.full((rows, chunk), pad, np.int32)
      padding = np.full((rows, chunk), -1, np.int32)  # positions and segment ids
      pages = np.full((rows, chunk), cfg.num_pages, np.int32)
      kv, _ = calls.prefill_packed(params, kv, tokens, padding, padding, pages)
      shapes += 1
    # Admission copies partly filled pages (a shared prompt's, a kept turn's): up to one per
    # admitted request, bucketed; targets out of range write nothing.
    copies = cfg.share_prefix or cfg.keep_turn_kv
    for count in sorted({bucket(n, 1) for n in range(1, cfg.max_running + 1)}) if copies else ():
      nowhere = np.full((count,), cfg.num_pages, np.int32)
      kv = calls.copy_pages(kv, np.zeros((count,), np.int32), nowhere)
      shapes += 1
    jax.block_until_ready(kv)
  finally:
    engine._kv = kv  # each call donated the cache it was given
  return shapes
