"""The programs a paged engine can run, compiled before it meets them.

- `precompile_engine` (`PagedEngine.precompile`): every decode window, prefill call, page
  copy and row update between windows (`decode_loop.DeviceBatch`), run once on padding rows
  (position -1: they read and write no cache; row updates on a batch of their own), before
  anything else runs.
- `compile_engine_ahead` (`PagedConfig.compile_ahead`): the same programs compiled, not run,
  on background threads while the engine generates (`jaxrl.compile_ahead`)."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from jaxrl.compile_ahead import abstract, compile_in_background, with_shardings
from jaxrl.rollout.decode_loop import dead_rows, stop_width
from jaxrl.rollout.engine import bucket
from jaxrl.rollout.requests import pages_for
from jaxrl.rollout.window_kv import ring_table

if TYPE_CHECKING:
  from jaxrl.rollout.paged import PagedEngine

log = logging.getLogger(__name__)


class EngineProgram(NamedTuple):
  """One program of the engine: its jitted function (`PagedCalls`', or a row update's of
  `DeviceBatch`), the call that runs it and its arguments after what it `reads` first
  ("weights": the weights and the KV pool; "pool": the KV pool, a page copy; "rows": nothing,
  a row update), host arrays but for a decode window's or row update's first two, the rows'
  state and sampling, which the device holds laid out as `DeviceBatch` keeps them
  (`on_device`)."""

  jitted: object
  call: object
  args: tuple
  on_device: bool = False
  reads: str = "weights"


def engine_programs(
  engine: PagedEngine,
  stop_widths: Sequence[int],
  filter_widths: Sequence[int],
  max_tokens: int | None,
  chunked: bool = True,
) -> list[EngineProgram]:
  """Every program `engine` can run for requests of these stop-id counts and sampler filters
  (`PagedEngine.precompile`'s arguments): a decode window per (row count, page-table width),
  prefill calls per (row count, chunk width), a page copy per bucket of copies, and the row
  updates: a `set_rows` per row count and a re-layout into and out of the largest
  (`decode_loop.DeviceBatch`). `chunked` False leaves out the chunked prefill (one sequence
  to a row: sequences longer than a packed row, a next turn after its kept pages)."""
  cfg, mc = engine.cfg, engine.model.config
  stop_widths = sorted({stop_width(n) for n in stop_widths})
  calls, pad = engine._calls, engine.pad_id
  max_tokens = max_tokens or (cfg.max_tokens if cfg.max_tokens > 0 else mc.max_seq_len)
  max_tokens = min(max_tokens, mc.max_seq_len)
  row_counts = engine._block_row_counts(engine.rows_per_shard)
  max_pages = pages_for(max_tokens, cfg.page_size)
  widths = sorted({engine._table_width(p) for p in range(1, max_pages + 1)})
  # Prefill caches every token but the last: chunks of up to `max_tokens - 1`.
  longest_chunk = max(1, min(cfg.prefill_chunk, max_tokens - 1))
  chunks = sorted({engine._chunk_width(c) for c in range(1, longest_chunk + 1)})
  # Packed, sequences of up to `prefill_chunk + 1` tokens meet the chunked call only as a
  # next turn's tokens after its kept pages (`keep_turn_kv`).
  chunked = chunked and (
    not cfg.pack_prefill or cfg.keep_turn_kv or max_tokens > cfg.prefill_chunk + 1
  )

  def prefill_rows(chunk: int) -> list[int]:  # blocks of a shard's rows, to `prefill_tokens`
    return engine._block_row_counts(min(engine.rows_per_shard, engine._chunk_row_cap(chunk)))

  rings = engine.ring_pages > 0  # the window pool's tables (`window_kv`), else None

  def tables(rows: int, width: int) -> tuple:  # page tables of padding rows
    table = np.zeros((rows, width), np.int32)
    return table, ring_table([], rows, width) if rings else None

  programs = []  # in the order a generation first meets them: its admission, then the rows
  for chunk in chunks if cfg.pack_prefill else ():
    for rows in prefill_rows(chunk):
      tokens = np.full((rows, chunk), pad, np.int32)
      padding = np.full((rows, chunk), -1, np.int32)  # positions and segment ids
      pages = np.full((rows, chunk), engine.allocator.num_pages, np.int32)
      ring_pages = (
        np.full((rows, chunk), engine.ring_allocator.num_pages, np.int32) if rings else None
      )
      args = (tokens, padding, padding, pages, ring_pages)
      programs.append(EngineProgram(calls._prefill_packed, calls.prefill_packed, args))
  # Admission copies partly filled pages (a shared prompt's, a kept turn's): up to one per
  # admitted request, bucketed, and a shared prompt's ring for each request that shares it;
  # targets out of range write nothing.
  copies = cfg.share_prefix or cfg.keep_turn_kv
  admitted = range(1, cfg.max_running + 1)
  copy_programs = [(calls.copy_pages, engine.allocator.num_pages, {bucket(n, 1) for n in admitted})]
  if rings and cfg.share_prefix:
    counts = {bucket(n * engine.ring_pages, 1) for n in admitted}
    copy_programs.append((calls.copy_ring_pages, engine.ring_allocator.num_pages, counts))
  for copy, pool, counts in copy_programs if copies else ():
    for count in sorted(counts):
      nowhere = np.full((count,), pool, np.int32)
      args = (np.zeros((count,), np.int32), nowhere)
      programs.append(EngineProgram(copy, copy, args, reads="pool"))
  batch = engine._batch  # the row updates between windows: admissions, kills, re-layouts
  for stops in stop_widths:
    dead, largest = dead_rows(1, stops, pad), dead_rows(batch.max_rows, stops, pad)
    for rows in row_counts:
      state, sampling = dead_rows(rows, stops, pad)
      nowhere = np.full((rows,), rows, np.int32)  # every entry out of range: writes nothing
      args = (state, sampling, nowhere, state, sampling)
      programs.append(EngineProgram(batch._set_rows, batch._set_rows, args, True, "rows"))
    for rows in row_counts[1:]:  # into and out of the largest, `max_rows` (first)
      for source, into in ((dead_rows(rows, stops, pad), batch.max_rows), (largest, rows)):
        args = (*source, np.full((into,), -1, np.int32), *dead)
        programs.append(EngineProgram(batch._gather_rows, batch._gather_rows, args, True, "rows"))
  for rows, width in itertools.product(row_counts, widths):
    for stops, filters in itertools.product(stop_widths, filter_widths):
      call = calls.decoder(filters)  # made on first use
      args = (*dead_rows(rows, stops, pad), *tables(rows, width))
      programs.append(EngineProgram(calls.decoders[filters], call, args, True))
  for chunk in chunks if chunked else ():
    for rows, width in itertools.product(prefill_rows(chunk), widths):
      tokens = np.full((rows, chunk), pad, np.int32)
      positions = np.full((rows, chunk), -1, np.int32)
      args = (tokens, positions, *tables(rows, width))
      programs.append(EngineProgram(calls._prefill, calls.prefill, args))
  return programs


def precompile_engine(
  engine: PagedEngine,
  stop_widths: Sequence[int],
  filter_widths: Sequence[int],
  max_tokens: int | None,
  stopped: Callable[[], bool] = lambda: False,
) -> int:
  """Runs each program of `engine_programs` once, until `stopped()`; returns how many ran. A
  part of `PagedEngine`, apart for the module's length: it uses the engine's calls and updates
  its KV cache."""
  calls, params, kv = engine._calls, engine.params, engine._kv
  programs = engine_programs(engine, stop_widths, filter_widths, max_tokens)
  ran = 0
  try:
    for program in programs:
      if stopped():
        break
      ran += 1
      args = program.args
      calls.note(program.jitted, args)
      if program.on_device:
        state, sampling, *tables = args
        args = (*calls.put((state, sampling), calls.row_state_shardings), *tables)
      if program.reads == "rows":  # a row update of a batch of its own
        program.call(*args)
      elif program.reads == "pool":
        kv = program.call(kv, *args)
      elif program.on_device:  # a decode window: (output, state, kv)
        *_, kv = program.call(params, kv, *args)
      else:  # a prefill: (kv, routes)
        kv, _ = program.call(params, kv, *args)
    jax.block_until_ready(kv)
  finally:
    engine._kv = kv  # each call donated the cache it was given
  return ran


def compile_engine_ahead(
  engine: PagedEngine, stop_width: int, filter_width: int, params=None
) -> list[Future]:
  """Starts compiling the programs of `engine_programs` for one stop-id width and sampler
  filter on background threads, in the order a generation meets them; returns their futures.
  The chunked prefill is left out where the engine packs prompts and keeps no turn's pages:
  a single-turn run meets it only for a prompt longer than a packed row or a preempted
  request's prefill, and its programs (a row count and page-table width each) would add that
  many to the start's work. A multi-turn engine (`keep_turn_kv`) prefills every next turn
  that way, so there it is compiled too.
  The weights and the KV pool are read for their shapes now (the calls donate the pool
  meanwhile). A call that needs a program while a thread compiles it waits for that compile
  (JAX's caches let one compile run for both); one that comes before its thread began
  compiles it itself, and the thread then finds it compiled. A failure is logged: the call
  that needs the program compiles it again, and fails there if it fails again. The programs
  not begun are skipped once the engine's owner stops it (`PagedEngine.stop_precompiling`).
  `params`: the weights' shapes on their shardings (default: the engine's weights')."""
  params = abstract(engine.params) if params is None else params
  lowerings = [lower for _, lower in engine_lowerings(engine, stop_width, filter_width, params)]
  futures = compile_in_background(lowerings, _workers(), engine._stop_precompiling)
  for future in futures:
    future.add_done_callback(_log_failure)
  return futures


def engine_lowerings(engine: PagedEngine, stop_width: int, filter_width: int, params) -> list:
  """(program, a function that traces and lowers it) of each program `compile_engine_ahead`
  compiles, for weights of these shapes (`jax.ShapeDtypeStruct`s with their shardings) and
  the KV pool's: the engine needs neither its weights, nor its pool, nor its devices."""
  calls = engine._calls
  kv = calls.abstract_kv
  chunked = not engine.cfg.pack_prefill or engine.cfg.keep_turn_kv
  out = []
  for program in engine_programs(engine, (stop_width,), (filter_width,), None, chunked):
    args = program.args
    calls.note(program.jitted, args)  # compiled for this engine, once its thread gets to it
    if program.on_device:  # laid out as `DeviceBatch` keeps them
      state, sampling, *tables = args
      args = (*with_shardings((state, sampling), calls.row_state_shardings), *tables)
    head = {"weights": (params, kv), "pool": (kv,), "rows": ()}[program.reads]
    out.append((program, lambda jitted=program.jitted, a=head + args: jitted.lower(*a)))
  return out


def _log_failure(future: Future) -> None:
  if not future.cancelled() and future.exception() is not None:
    log.warning("An engine program failed to compile ahead: %r", future.exception())


def _workers() -> int:  # compiles at once: XLA spreads each over cores of its own too
  return max(2, min(8, os.cpu_count() or 2))
