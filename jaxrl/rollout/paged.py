"""Continuous batching over a paged KV cache, with the decode loop resident on the device.

Requests join and leave a running batch between decode windows. Keys and values live in
fixed-size pages shared by all sequences; a host-side scheduler hands pages out, frees them when a
request finishes, and, when pages run out, preempts the youngest running request (frees its
pages, keeps its tokens) to resume it later by re-prefilling its prompt plus generated prefix.
A finished multi-turn turn (`RequestRecord.keep_kv`) leaves its pages parked (`kv_park`) for
its next turn, which prefills only the tokens after them; parked pages are evicted first.

Invariant: a running request has keys/values cached for all its tokens but the last; the next
decode step feeds that last token, caches it, and samples the following one. Prefill therefore
only fills the cache (packed rows or chunks, `prefill`); it never samples.

One device call runs a window of `decode_steps` decode steps (a scan on the device). Each
row's decode state (next token, position, budget, token index, live flag) and sampling
parameters stay on the device (`decode_loop`): a window starts from the state the last one left,
so the host dispatches window N+1 before it reads window N back, and builds the next page table
while the device works. Admission writes the new rows into free slots, and a batch that grows or
shrinks is re-laid out, on the device; only preemption and abort wait for the window in flight
(they need its tokens). The host learns that a request finished one window late, so pages are
handed out for the window in flight and the next one. A row stops inside a window at a stop
token or its length limit and writes nothing after. Sampling keys depend only on (request seed,
token index), so the tokens are the same for every window size.

On a mesh whose rows split over several devices (`data`), the pool splits with them
(`shards`): each device holds `num_pages` pages of its own rows' requests, a request runs on one
device's rows and pages (`admission`), and every call lays its rows out in a block for each.

Glossary: b rows, t tokens per row, n pages per row, k kv heads, p pages, z page size, e head dim.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from jaxrl.model import Model, Params
from jaxrl.model.scan_fit import fit_scan
from jaxrl.rollout.admission import Running, admit_waiting
from jaxrl.rollout.decode_loop import (
  DeviceBatch,
  RowStart,
  WindowOutput,
  block_order,
  stop_width,
)
from jaxrl.rollout.engine import Completion, ParamPlacer, bucket
from jaxrl.rollout.kv_park import KVPark
from jaxrl.rollout.paged_calls import PagedCalls
from jaxrl.rollout.paged_config import PagedConfig
from jaxrl.rollout.precompile import compile_engine_ahead, precompile_engine
from jaxrl.rollout.prefill import prefill_admitted
from jaxrl.rollout.requests import (
  PageAllocator,
  RequestRecord,
  check_request,
  pages_for,
  record_completion,
)
from jaxrl.rollout.sampling import (
  NO_FILTER,
  SORT_ALL,
  TOP_K_CANDIDATES,
  SamplingParams,
  filter_width,
)
from jaxrl.rollout.window_kv import ring_table, window_pool
from jaxrl.sharding import tree_shardings


@dataclasses.dataclass
class _InFlight:
  """A dispatched window whose tokens the host has not read back yet."""

  output: WindowOutput
  rows: list[Running | None]  # the batch's rows when it was dispatched
  steps: int
  version: int


class PagedEngine:
  """Continuous-batching engine; also answers to `RolloutEngine` through `generate`."""

  def __init__(
    self,
    model: Model,
    mesh: jax.sharding.Mesh,
    rules,
    *,
    eos_id: int,
    pad_id: int,
    config: PagedConfig = PagedConfig(),
  ):
    self.model = model
    self.mesh = mesh
    self.cfg = config
    self.eos_id = eos_id
    self.pad_id = pad_id
    self.version = -1
    self.params: Params | None = None
    shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
    self.param_shardings = tree_shardings(model.logical_axes, mesh, rules, shapes)
    # The packed prefill's scan holds a stacked copy of the blocks' weights: off where large.
    self.model = model = fit_scan(model, mesh, self.param_shardings, copies=1)
    self._placer = ParamPlacer(self.param_shardings, model.abstract_params())
    # The sliding-window layers' pool (`window_kv`): R pages a request; none: (0, 0).
    self.ring_pages, window_pages = window_pool(config, model.config)
    self._calls = PagedCalls(model, mesh, rules, self.param_shardings, config, window_pages)
    # The KV page pool: allocated with the first weights (`update_weights`), None while
    # released (`release_memory`).
    self._kv = None
    self._precompiled = False
    # Set by `stop_precompiling` (from another thread): `precompile` ends after its program.
    self._stop_precompiling = threading.Event()
    self._compiled_ahead = False  # `PagedConfig.compile_ahead` started (at most once)
    # The rows split over `shards` devices (groups of devices along the rows' axes), each
    # with `num_pages` pages of its own and at most `rows_per_shard` running requests.
    self.shards = shards = self._calls.page_shards
    self.rows_per_shard = -(-config.max_running // shards)
    self.allocator = PageAllocator(config.num_pages, shards)
    self.ring_allocator = PageAllocator(window_pages, shards) if window_pages else None
    self.waiting: collections.deque[RequestRecord] = collections.deque()
    self.running: dict[str, Running] = {}
    self._admissions = itertools.count()
    self._ids = itertools.count()
    self.num_preemptions = 0
    self._inflight: _InFlight | None = None
    self._finished: list[RequestRecord] = []  # read back outside `step`'s own read-back
    self.num_windows = 0
    self.num_shared_prefill_tokens = 0  # prompt tokens not prefilled: shared with a leader
    self.num_kept_prefill_tokens = 0  # prompt tokens not prefilled: parked by the last turn
    # `park.num_evicted_pages`: given up under pressure.
    self.park = KVPark(self.allocator, self.ring_allocator)
    # Read-backs that found no window queued behind them: the device waited for the host.
    self.num_host_waits = 0
    self._batch = DeviceBatch(
      self._calls.row_state_shardings, pad_id, put=self._calls.put, shards=shards,
      max_rows=self._block_row_counts(self.rows_per_shard)[0], note=self._calls.note,
    )  # fmt: skip
    # The smallest page table and prefill chunk of any call (`PagedConfig.max_tokens`).
    sized_for = min(config.max_tokens, model.config.max_seq_len)
    self._min_table_width = (
      bucket(pages_for(sized_for, config.page_size), 1) if sized_for > 0 else 1
    )
    self._min_chunk = (
      bucket(min(config.prefill_chunk, max(sized_for - 1, 1))) if sized_for > 0 else 1
    )

  # -- requests ----------------------------------------------------------------------------------

  def update_weights(self, params: Params, version: int) -> None:
    """New weights take effect at the next decode window; later tokens carry `version`.
    Parked pages are dropped: keys/values of the old weights must not enter a new turn."""
    self.park.clear()
    self.params = self._placer(params)
    self.version = version
    if self._kv is None:
      self._kv = self._calls.new_kv()
    if self.cfg.precompile and not self._precompiled:
      self.precompile()

  def release_memory(self) -> None:
    """Drops the weights and the KV page pool (every page is free: no request may be in the
    engine); `update_weights` allocates the pool again."""
    if self.has_work:
      raise RuntimeError(
        f"PagedEngine.release_memory with {len(self.running)} running and {len(self.waiting)} "
        "waiting requests in the engine; finish them (`stream`) or `abort` them first."
      )
    self.park.clear()
    self.params = None
    self._kv = None

  def precompile(
    self,
    stop_widths: Sequence[int] = (1,),
    filter_widths: Sequence[int] = (NO_FILTER, TOP_K_CANDIDATES, SORT_ALL),
    max_tokens: int | None = None,
  ) -> int:
    """Compiles every decode window, prefill call, page copy and row update this engine can
    make, running each shape once on padding rows (position -1: they read and write no cache),
    so that none compiles mid-run. `stop_widths`: the numbers of stop ids a request may have
    (its end token and `SamplingParams.stop_token_ids`), to cover (1: the end token only; up
    to `decode_loop.MIN_STOP_WIDTH` ids share one width);
    `filter_widths`: the sampler variants to cover (`sampling.filter_width`); `max_tokens`:
    the longest sequence (prompt and response) the run will give it, which bounds the page
    tables and prefill chunks to cover (default: `PagedConfig.max_tokens` when set, else the
    model's `max_seq_len`, where a model of 40k positions would cover tables a 1k-token run
    never builds).
    Needs weights. Returns the number of shapes run."""
    if self.params is None:
      raise ValueError("PagedEngine.precompile needs weights first: call update_weights.")
    shapes = precompile_engine(
      self, stop_widths, filter_widths, max_tokens, self._stop_precompiling.is_set
    )
    self._precompiled = not self._stop_precompiling.is_set()
    return shapes

  def stop_precompiling(self) -> None:
    """For an engine whose owner is stopping (any thread): a `precompile` under way ends after
    the program it is compiling, the threads compiling ahead (`PagedConfig.compile_ahead`)
    after theirs, and none runs from now on. Over a hundred programs can take minutes, which
    a stopping rollout worker would otherwise wait out, or leave compiling beside what the
    process runs next."""
    self._stop_precompiling.set()

  @property
  def kv_pool_bytes(self) -> int:
    """Bytes of its KV pools, every layer's keys and values (0 while released)."""
    return 0 if self._kv is None else sum(k.nbytes + v.nbytes for k, v in self._kv)

  def compiled_shapes(self) -> int:
    """Programs compiled for this engine so far (by it, or by an engine of the same settings
    in the process: `PagedCalls.compiled`): decode windows, prefills, page copies and row
    updates."""
    return self._calls.compiled()

  def submit(
    self,
    request: RequestRecord | Sequence[int],
    sampling: SamplingParams | None = None,
    *,
    request_id: str | None = None,
    seed: int = 0,
  ) -> str:
    """Queues a new prompt, or a record from `snapshot`/`abort` to continue; returns its id."""
    if isinstance(request, RequestRecord):
      record = request
    else:
      record = RequestRecord(
        request_id=request_id or f"r{next(self._ids)}",
        prompt_ids=[int(t) for t in request],
        sampling=sampling or SamplingParams(),
        seed=seed,
      )
    self._validate(record)
    self.waiting.append(record)
    return record.request_id

  def _validate(self, record: RequestRecord) -> None:
    rid, limit = record.request_id, self.model.config.max_seq_len
    if record.finish_reason is not None:
      raise ValueError(f"Request {rid} is already finished ({record.finish_reason}).")
    if rid in self.running or any(r.request_id == rid for r in [*self.waiting, *self._finished]):
      raise ValueError(f"Request id {rid} is already in this engine.")
    check_request(record, limit, self.cfg.page_size, self.cfg.num_pages)

  @property
  def num_prefill_tokens(self) -> int:
    """Tokens its prefill calls computed (padding left out), re-prefills after preemption in."""
    return self._calls.num_prefill_tokens

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running or self._inflight or self._finished)

  def snapshot(self, request_id: str) -> RequestRecord:
    """Stops a request and returns its record; `submit` it on any engine to continue."""
    return self.abort([request_id])[0]

  def drain(self) -> list[RequestRecord]:
    """Waits for the window in flight and returns every request that finished and was not
    returned yet (by `step`); afterwards every running record holds all its tokens. Drops
    parked pages (callers drain before new weights or leaving)."""
    self._read_back()
    self.park.clear()
    finished, self._finished = self._finished, []
    return finished

  def drop_kept(self, request_id: str) -> bool:
    """Frees the pages parked for `request_id`'s next turn (its episode ended); False when
    none were parked (never kept, evicted, or already reused)."""
    return self.park.drop(request_id)

  def abort(self, request_ids: Sequence[str]) -> list[RequestRecord]:
    """Removes requests (running or waiting) and returns their partial records, with the
    tokens of the window in flight (this waits for it). A request that finished in that window
    comes back finished (`finish_reason` set): call `drain` first to collect those apart."""
    self._read_back()
    held = [*self.running, *(r.request_id for r in [*self._finished, *self.waiting])]
    unknown = [rid for rid in request_ids if rid not in held]
    if unknown or len(set(request_ids)) != len(request_ids):  # checked before removing any
      raise KeyError(
        f"Requests {unknown or list(request_ids)} are not each once running, waiting or "
        "finished unreturned in this engine; nothing was aborted."
      )
    out = []
    for rid in request_ids:
      if rid in self.running:
        out.append(self.running[rid].record)
        self._remove(self.running[rid])
        continue
      done = any(r.request_id == rid for r in self._finished)
      queue = self._finished if done else self.waiting
      out.append(next(r for r in queue if r.request_id == rid))
      queue.remove(out[-1])
    return out

  # -- the loop ----------------------------------------------------------------------------------

  def step(self) -> list[RequestRecord]:
    """Admits what fits and dispatches one decode window (up to `decode_steps` tokens for every
    running request), then reads the previous window back; returns the requests that finished.

    The tokens of the window dispatched here are read by the next call (or `drain`), so a
    request is returned one call after the window it finished in.
    """
    if self.params is None:
      raise RuntimeError("PagedEngine.step called before update_weights gave it weights.")
    self._admit()
    if not self.running and self._inflight is not None:
      self._read_back()  # frees the pages of what finished: admit into them
      self._admit()
    window = self._window() if self.running else 0
    if window:
      self._grow_pages(window)  # its read-back, if any, may end every running request
      previous = self._dispatch(window) if self.running else None
      if previous is not None:
        self._consume(previous, waited=False)  # the device runs the window just dispatched
    elif self.waiting and not self.running and self._inflight is None:
      raise RuntimeError("No request fits the free pages although none is running.")
    else:
      self._read_back()  # every running row ends in the window in flight
    finished, self._finished = self._finished, []
    return finished

  def stream(self) -> Iterator[RequestRecord]:
    """Steps until no work is left, yielding each request as soon as it finishes."""
    while self.has_work:
      yield from self.step()

  def generate(self, prompts, sampling, *, seed: int) -> list[Completion]:
    """Runs the prompts to completion (the `RolloutEngine` interface); results in order."""
    per_row = list(sampling) if isinstance(sampling, Sequence) else [sampling] * len(prompts)
    if len(per_row) != len(prompts):
      raise ValueError(f"Got {len(per_row)} SamplingParams for {len(prompts)} prompts.")
    ids = [
      self.submit(p, sp, seed=(seed * 1_000_003 + i) % (2**31 - 1))
      for i, (p, sp) in enumerate(zip(prompts, per_row, strict=True))
    ]
    done = {r.request_id: r for r in self.stream()}
    return [record_completion(done[i]) for i in ids]

  # -- scheduling --------------------------------------------------------------------------------

  def _admit(self) -> None:
    """Admits waiting requests while rows and pages last (`admission.admit_waiting`)."""
    admit_waiting(self)

  def _compile_ahead(self, admitted: Sequence[Running]) -> None:
    """`PagedConfig.compile_ahead`, for the stop-id width and sampler filter of the first
    admission (one that later differs compiles its programs when they come). Not on a mesh
    of several processes, whose calls take global arrays: that their programs land in the
    same caches is untested."""
    wanted = self.cfg.compile_ahead and self.cfg.max_tokens > 0 and not self._precompiled
    if self._compiled_ahead or not wanted or self.mesh.is_multi_process:
      return
    self._compiled_ahead = True
    stops = stop_width(max(len(self._stop_ids(s.record)) for s in admitted))
    width = filter_width(s.record.sampling for s in admitted)
    compile_engine_ahead(self, stops, width)

  def _budget(self, record: RequestRecord) -> int:
    """Tokens the request may still generate before its length limit (as read back so far)."""
    return min(
      record.sampling.max_new_tokens - len(record.token_ids),
      self.model.config.max_seq_len - record.num_tokens,
    )

  def _window(self) -> int:
    """Steps of the next device call: `decode_steps`, or 0 when every running request ends in
    the window in flight. One window size, so one decode program per (rows, page-table width,
    sampler filter): windows cut to the longest budget left would compile 4 sizes of each for
    `decode_steps=8`, to save at most 7 idle steps at the end of a run (rows past their budget
    write nothing)."""
    longest = max(self._budget(s.record) - s.pending for s in self.running.values())
    return self.cfg.decode_steps if longest > 0 else 0

  def _grow_pages(self, window: int) -> None:
    """Gives every running request pages for the tokens the window in flight and the next one
    may cache, preempting the youngest when pages run out (after reading the window in flight
    back: a preempted record keeps every token). A window caches the request's last token and
    the tokens it samples but the final one."""
    for state in sorted(self.running.values(), key=lambda s: s.admitted):
      if state.record.request_id not in self.running:
        continue  # preempted, or finished in the window read back below
      r = state.record
      cached = r.num_tokens - 1 + min(state.pending + window, self._budget(r))
      need = pages_for(cached, self.cfg.page_size) - len(state.pages)
      while need > 0:
        # Parked pages go first, then the youngest request of its shard.
        pages = self.park.allocate(need, state.shard)
        if pages is not None:
          state.pages.extend(pages)
          break
        if self._inflight is not None:
          self._read_back()  # frees what finished; the rest then needs pages for `window` only
          if state.record.request_id not in self.running:
            break
          need = pages_for(r.num_tokens - 1 + min(window, self._budget(r)), self.cfg.page_size)
          need -= len(state.pages)
          continue
        same = (s for s in self.running.values() if s.shard == state.shard)
        youngest = max(same, key=lambda s: s.admitted)
        self._preempt(youngest)
        if youngest is state:
          break

  def _preempt(self, state: Running) -> None:
    self._remove(state)
    self.waiting.appendleft(state.record)
    self.num_preemptions += 1

  def _remove(self, state: Running) -> None:
    """Takes a running request out (its record complete: nothing of it in flight), frees its
    pages and marks its row dead on the device."""
    del self.running[state.record.request_id]
    self.park.free_pages(state.pages, state.ring)
    self._batch.kill(state.row)

  # -- the device batch --------------------------------------------------------------------------

  def _place(self, admitted: Sequence[Running]) -> None:
    """Gives the admitted requests rows of the device batch and their start there."""
    keep = [s for s in self._batch.rows if s is not None]
    new = []
    for state in admitted:
      r = state.record
      start = RowStart(
        token=r.token_ids[-1] if r.token_ids else r.prompt_ids[-1],
        position=r.num_tokens - 1,
        budget=self._budget(r),
        index=len(r.token_ids),
        seed=r.seed,
        temperature=r.sampling.temperature,
        top_k=r.sampling.top_k,
        top_p=r.sampling.top_p,
        stop_ids=self._stop_ids(r),
      )
      new.append((state, start))
    rows = self._block_rows([*keep, *(state for state, _ in new)])
    stops = stop_width(max(len(x.stop_ids) for _, x in new))
    self._batch.place(sorted(keep, key=lambda s: s.admitted), new, rows, stops)

  def _table_width(self, pages: int) -> int:
    return max(bucket(pages, 1), self._min_table_width)

  def _chunk_width(self, tokens: int) -> int:
    return max(bucket(tokens), self._min_chunk)

  def _page_tables(
    self, states: Sequence[Running | None], rows: int
  ) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows' page tables of the main pool and of the window pool (None without one)."""
    width = self._table_width(max(len(s.pages) for s in states if s is not None))
    table = np.zeros((rows, width), np.int32)
    for i, s in enumerate(states):
      if s is not None:
        table[i, : len(s.pages)] = s.pages
    if not self.ring_pages:
      return table, None
    return table, ring_table([s and s.ring for s in states], rows, width)

  def _prefill_row_cap(self, width: int) -> int:
    """The most rows of one prefill call of `width` tokens a row (`prefill_tokens`)."""
    return max(1, self.cfg.prefill_tokens // width)

  def _chunk_row_cap(self, width: int) -> int:
    """The most rows of a shard in one chunked prefill call of `width` tokens a row."""
    return max(1, self._prefill_row_cap(width) // self.shards)

  def _block_row_counts(self, most: int) -> list[int]:
    """Every row count of a `_block_rows` call of at most `most` rows a shard, largest first."""
    return sorted({self.shards * bucket(n, 1) for n in range(1, most + 1)}, reverse=True)

  def _block_rows(self, states: Sequence[Running]) -> int:
    """Rows of a call of `states`' rows, each on its shard's devices, which hold its pages
    (decode windows, prefills): a block of the same bucketed size for each shard."""
    counts = collections.Counter(s.shard for s in states)
    return self.shards * bucket(max(counts.values(), default=1), 1)

  def _block_order(self, states: Sequence[Running]) -> list[int | None]:
    """The rows of a `_block_rows` call of `states`: the index of the state each holds, each
    in its shard's block (`decode_loop.block_order`); None: a padding row."""
    return block_order([s.shard for s in states], self.shards, self._block_rows(states))

  def _prefill_states(self, states: Sequence[Running], starts: Sequence[int]) -> None:
    prefill_admitted(self, states, starts)

  def _dispatch(self, window: int) -> _InFlight | None:
    """Runs the next window from the state the last one left (nothing read from the device);
    returns the window that was in flight before, for the caller to read back."""
    batch = self._batch
    tables = self._page_tables(batch.rows, len(batch.rows))
    width = filter_width(s.record.sampling for s in self.running.values())
    output, batch.state, self._kv = self._calls.decoder(width)(
      self.params, self._kv, batch.state, batch.sampling, *tables
    )
    for state in self.running.values():
      state.pending += window
    previous = self._inflight
    self._inflight = _InFlight(output, list(batch.rows), window, self.version)
    self.num_windows += 1
    return previous

  def _read_back(self) -> None:
    """Waits for the window in flight, if any, and takes its tokens (the device idles after)."""
    if self._inflight is not None:
      inflight, self._inflight = self._inflight, None
      self._consume(inflight, waited=True)

  def _consume(self, window: _InFlight, *, waited: bool) -> None:
    """Appends a window's tokens to its requests; the finished ones leave the engine."""
    out, host = window.output, self._calls.host
    tokens_wb, logprobs_wb, taken_b = host(out.tokens_wb), host(out.logprobs_wb), host(out.taken_b)
    routing_wblk = None if out.routing_wblk is None else host(out.routing_wblk)
    self.num_host_waits += waited
    for i, s in enumerate(window.rows):
      if s is None or self.running.get(s.record.request_id) is not s:
        continue  # a free row, or a request that finished in an earlier window
      s.pending -= window.steps
      r, taken = s.record, int(taken_b[i])
      if taken:
        # A row stops on the device after a stop token or at its budget, so only its last
        # token can end it (a column's tokens at once: per token, this loop was a fifth of
        # the host's time on the `micro` preset).
        r.token_ids.extend(tokens_wb[:taken, i].tolist())
        r.logprobs.extend(logprobs_wb[:taken, i].tolist())
        r.versions.extend([window.version] * taken)
        if routing_wblk is not None:
          r.routing.extend(routing_wblk[:taken, i].tolist())
        if r.token_ids[-1] in self._stop_ids(r):
          r.finish_reason = "stop"
        elif self._budget(r) <= 0:
          r.finish_reason = "length"
      if r.finish_reason:
        # Its row is dead on the device already (it stopped there too); free it for admission.
        del self.running[r.request_id]
        keep = r.keep_kv and self.cfg.keep_turn_kv and s.version == self.version
        if keep:
          self.park.keep(r, s.pages, s.ring, self.cfg.page_size)
        else:
          self.park.free_pages(s.pages, s.ring)
        self._batch.free(s.row)
        self._finished.append(r)

  def _stop_ids(self, record: RequestRecord) -> tuple[int, ...]:
    eos = () if record.sampling.ignore_eos else (self.eos_id,)
    return eos + tuple(record.sampling.stop_token_ids)
