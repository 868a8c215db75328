"""Settings of the paged engine (`jaxrl.rollout.paged`), apart so that the config tree
(`jaxrl.config`) reads them without the engine."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  """Settings of the paged engine.

  Attributes:
    page_size: token slots per KV page.
    num_pages: the page budget (per layer) of the main pool: every layer's, but those with a
      sliding window where they have a pool of their own (`window_pages`); bounds the tokens
      cached at once. A model windowed in every layer then allocates no main pool, and
      `num_pages` only bounds its running requests' lengths together. Pages of one device:
      an engine whose rows split over several devices (`data`) has this many on each, for
      the requests whose rows it holds (`PagedEngine.shards`), so its capacity grows with
      them; a request must fit one device's pages.
    max_running: most requests decoded together in one step; over several devices of
      `data`, at most `ceil(max_running / devices)` on each.
    prefill_chunk: most prompt tokens of one request prefilled per call.
    decode_steps: most decode steps per device call (the window). Larger windows pay the
      host's per-step cost less often; a request that finishes inside a window leaves its row
      idle until the window ends, and waiting requests are admitted only between windows.
    precompile: compile every decode and prefill shape the engine can meet when it first gets
      weights (`PagedEngine.precompile`), and the row updates between windows, for requests
      of up to 4 stop ids (end token included), so that no compilation stalls generation
      later; a long-tail workload otherwise meets a new shape now and then, mid-run. It
      compiles one function per (row bucket, page-table width, window or prefill width):
      over a hundred for `max_running=128`, a cost that pays off in long runs only. A
      rollout worker that stops meanwhile stops it after the program under way
      (`PagedEngine.stop_precompiling`).
    share_prefix: requests admitted together with the same tokens so far (GRPO's G responses
      to one prompt) are prefilled once and share its full KV pages (reference-counted); each
      gets its own copy of the last, partly filled page, which its decode writes into.
    max_tokens: the longest sequence (prompt and response) the run expects; > 0 sizes every
      page table for it and every prefill chunk at `min(prefill_chunk, max_tokens)` (bucketed),
      so the engine meets one program per row count (and sampler filter) instead of one per
      (rows, table width, chunk width): a run meets no new shape once it has seen each row
      count, and `precompile` covers that set alone. A longer sequence still runs, in wider
      shapes compiled when it comes. The attention of a step reads the whole table's width
      where no kernel stops at each row's length (the CPU reference path: a long-tail GRPO
      run's rollout took 1.26x as long on CPU, docs/BENCHMARKS.md). 0: tables and chunks
      bucketed to what each call needs. -1 (auto): the RL job sizes them from its prompts and
      `max_new_tokens` on accelerators, buckets them on CPU; an engine built directly treats
      it as 0.
    pack_prefill: sequences that fit one `prefill_chunk` are prefilled packed, several to a
      row of up to `prefill_chunk` tokens (`jaxrl.rollout.prefill`), instead of one to a row
      padded to the longest: ragged prompts cost their own length. Off: one request per row.
    prefill_tokens: the most tokens (padding included) of one prefill call: an admission whose
      rows of prompts would pass it runs as several calls, each of at most
      `prefill_tokens // width` rows (at least one) of its chunk width. It bounds the prefill
      programs a run can meet (rows 1, 2, 4, ... up to that many) and their activations; at
      4,096 tokens a call still keeps an accelerator's matrix units busy.
    compile_ahead: with shapes sized (`max_tokens` > 0), no `precompile` and a mesh of one
      process: at its first admission the engine starts compiling, not running, every decode
      window, packed prefill, page copy and row update it can meet for that admission's
      stop-id width and sampler filter, on background threads (`jaxrl.rollout.precompile`),
      while it generates; a call whose program is compiling waits for that compile, one
      whose thread has not begun compiles it as before. A single-turn run then meets no new
      program mid-run (on an H100 the HF recipe's fourth step stalled 13 s to compile a
      packed prefill of more rows than before).
      The chunked prefill (prompts longer than a packed row, a preempted request's) still
      compiles when met, but for a next turn's after its kept pages (`keep_turn_kv`: the
      multi-turn job's engines), which is compiled ahead too. Bucketed shapes are compiled
      as they come: their set grows with `max_seq_len`.
    keep_turn_kv: a request that asks for it (`RequestRecord.keep_kv`: every multi-turn model
      turn) leaves its KV pages parked when it finishes (`jaxrl.rollout.kv_park`), and the
      next request with its id whose tokens extend its tokens (the next turn: the trajectory
      so far plus the environment's answer) reuses them, prefilling only the new tokens.
      Parked pages never hold up work: they are evicted, oldest first, before a request waits
      for pages or is preempted, and dropped when the weights change. Off: every turn is
      prefilled from its first token.
    window_pages: the pool of the layers with a sliding window (`ModelConfig.sliding_layers`:
      Gemma 2 and 3, Mistral-7B-v0.1, Phi-3), in which each running request holds a ring of
      pages that covers its window plus one call's tokens (`jaxrl.rollout.window_kv`) instead
      of a page for every position: Gemma 3 1B's 22 local layers then hold about 650 positions
      of a request (41 pages of 16 at the defaults) however long it grows, and `num_pages`
      sizes the pool of its 4 global layers alone. -1 (auto): `max_running` rings, where a
      ring is smaller than the longest sequence's pages (`max_tokens`, else the model's
      `max_seq_len`); a model without windows has no such pool. N > 0: that many pages (at
      least one ring; a request waits for a free ring, parked ones are evicted first). 0: the
      windowed layers keep every position in the main pool.
  """

  page_size: int = 16
  num_pages: int = 256
  max_running: int = 64
  prefill_chunk: int = 128
  decode_steps: int = 8
  precompile: bool = False
  share_prefix: bool = True
  max_tokens: int = -1
  pack_prefill: bool = True
  prefill_tokens: int = 4096
  compile_ahead: bool = True
  keep_turn_kv: bool = True
  window_pages: int = -1

  def __post_init__(self):
    names = ("page_size", "num_pages", "max_running", "prefill_chunk", "decode_steps")
    for name in (*names, "prefill_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"rollout.paged.{name} must be >= 1, got {getattr(self, name)}.")
    if self.window_pages < -1:
      raise ValueError(
        f"rollout.paged.window_pages must be -1 (auto), 0 (no ring pool) or the pages of the "
        f"sliding-window layers' pool, got {self.window_pages}."
      )
    if self.max_tokens < -1:
      raise ValueError(
        f"rollout.paged.max_tokens must be -1 (auto), 0 (bucketed shapes) or the longest "
        f"sequence to size shapes for, got {self.max_tokens}."
      )
