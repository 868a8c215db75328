"""Rings of KV pages for the sliding-window layers of the paged engine.

A layer with a sliding window of w positions (Gemma 2 and 3, Mistral-7B-v0.1, Phi-3) reads only
the last w keys of a sequence, yet in one shared pool it would hold every position: Gemma 3's
local layers (five of every six) would cache a 32k-token response whole to read 512 or 1,024
of its positions. Those layers get a pool of their own (`PagedConfig.window_pages`), in which
each running request holds a fixed ring of R pages: logical page i of its sequence lives in
ring page `i % R`. Its page table for those layers lists `ring[i % R]` for every logical page,
so the model, its kernels and their tests see an ordinary page table: they attend by position,
and an entry before the window (now holding a later page) is never read unmasked.

R covers the most positions one device call touches for a row: a decode window reads from
w - 1 positions before its first token and writes `decode_steps` tokens; a chunked prefill
reads as far back and writes `prefill_chunk` (a packed prefill writes at most that and reads
only its own row). A write then only ever replaces a page that no read of the same or a later
call needs (the calls are ordered on the device by the pool they pass on). The ring is fixed
for the request's stay in the engine: nothing is allocated or freed as it grows.

Glossary: b rows, n pages per row, z page size, R ring pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl.rollout.paged_config import PagedConfig
from jaxrl.rollout.requests import pages_for


def ring_size(window: int, page_size: int, config: PagedConfig) -> int:
  """Pages of one request's ring for layers with a `window`-position window: the most pages
  L consecutive positions can span (`pages_for(L - 1) + 1`), L being the positions one call
  touches (module docstring)."""
  touched = window - 1 + max(config.decode_steps, config.prefill_chunk)
  return pages_for(touched - 1, page_size) + 1


def window_pool(config: PagedConfig, model_config) -> tuple[int, int]:
  """(ring pages per request, pages of the sliding-window layers' pool), or (0, 0) where
  those layers share the main pool: a model without windows, `window_pages=0`, or (auto) a
  ring no smaller than the pages of the longest sequence the engine expects
  (`PagedConfig.max_tokens`, else the model's `max_seq_len`), where it would save nothing."""
  if not model_config.sliding_layers or config.window_pages == 0:
    return 0, 0
  ring = ring_size(model_config.sliding_window, config.page_size, config)
  if config.window_pages == -1:
    longest = model_config.max_seq_len
    if config.max_tokens > 0:
      longest = min(longest, config.max_tokens)
    if ring >= pages_for(longest, config.page_size):
      return 0, 0
    return ring, ring * config.max_running
  if config.window_pages < ring:
    raise ValueError(
      f"rollout.paged.window_pages={config.window_pages} cannot hold one request's ring of "
      f"{ring} pages (a window of {model_config.sliding_window} positions plus one call's "
      f"tokens, max(decode_steps, prefill_chunk) = "
      f"{max(config.decode_steps, config.prefill_chunk)}, in pages of {config.page_size}); "
      f"give at least {ring}, -1 for {ring} x max_running, or 0 to keep those layers in the "
      "main pool."
    )
  return ring, config.window_pages


def ring_table(rings: Sequence[Sequence[int] | None], rows: int, width: int) -> np.ndarray:
  """The sliding-window layers' page table [rows, width]: row i's logical page j in ring page
  `rings[i][j % R]`; rows without a ring (None, or past `rings`) read page 0 and write nothing
  (their positions are -1)."""
  table = np.zeros((rows, width), np.int32)
  logical = np.arange(width)
  for i, ring in enumerate(rings):
    if ring:
      table[i] = ring_pages(ring, logical)
  return table


def ring_pages(ring: Sequence[int], logical: np.ndarray) -> np.ndarray:
  """The ring page (int32) that holds each of a sequence's `logical` pages."""
  return np.asarray(ring, np.int32)[logical % len(ring)]
