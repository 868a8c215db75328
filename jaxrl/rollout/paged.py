"""Continuous batching over a paged KV cache.

Requests join and leave a running batch at every step. Keys and values live in fixed-size pages
shared by all sequences; a host-side scheduler hands pages out, frees them when a request
finishes, and, when pages run out, preempts the youngest running request (frees its pages, keeps
its tokens) to resume it later by re-prefilling its prompt plus generated prefix.

Invariant: a running request has keys/values cached for all its tokens but the last; the next
decode step feeds that last token, caches it, and samples the following one. Prefill therefore
only fills the cache (in chunks); it never samples.

One device call runs a window of up to `decode_steps` decode steps (a scan on the device), so
the host's per-step work (scheduling, page tables, transfers, reading tokens back) is paid once
per window: on a GPU that work, not the model, was most of a step's time. A row stops inside
the window at a stop token or its length limit and writes nothing after; pages are handed out
for the whole window before it starts. Admission, preemption and weight updates happen between
windows. Sampling keys depend only on (request seed, token index), so the tokens are the same
for every window size.

Glossary: b rows, t tokens per row, n pages per row, k kv heads, p pages, z page size, e head dim.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model import ExpertParallel, Model, MoEInputs, PagedLayerCache, Params
from jaxrl.rollout.engine import Completion, bucket, place_params
from jaxrl.rollout.requests import PageAllocator, RequestRecord, pages_for
from jaxrl.rollout.sampling import SamplingParams, needs_filter, sample_tokens
from jaxrl.sharding import batch_sharding, logical_to_pspec, tree_shardings


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  """Settings of the paged engine.

  Attributes:
    page_size: token slots per KV page.
    num_pages: the page budget (per layer); bounds the tokens cached at once.
    max_running: most requests decoded together in one step.
    prefill_chunk: most prompt tokens of one request prefilled per call.
    decode_steps: most decode steps per device call (the window). Larger windows pay the
      host's per-step cost less often; a request that finishes inside a window leaves its row
      idle until the window ends, and waiting requests are admitted only between windows.
    precompile: compile every decode and prefill shape the engine can meet when it first gets
      weights (`PagedEngine.precompile`), so that no compilation stalls generation later; a
      long-tail workload otherwise meets a new shape now and then, mid-run. It compiles one
      function per (row bucket, page-table width, window or prefill width): over a hundred for
      `max_running=128`, a cost that pays off in long runs only.
  """

  page_size: int = 16
  num_pages: int = 256
  max_running: int = 64
  prefill_chunk: int = 128
  decode_steps: int = 8
  precompile: bool = False

  def __post_init__(self):
    for name in ("page_size", "num_pages", "max_running", "prefill_chunk", "decode_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"rollout.paged.{name} must be >= 1, got {getattr(self, name)}.")


@dataclasses.dataclass
class _Running:
  record: RequestRecord
  pages: list[int]
  admitted: int  # admission order; the highest is the youngest


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
    # MoE on a mesh with an expert axis: the expert-parallel layer (else the reference).
    self._moe = MoEInputs(ExpertParallel.for_mesh(model.config, mesh))
    self.eos_id = eos_id
    self.pad_id = pad_id
    self.version = -1
    self.params: Params | None = None
    shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
    self.param_shardings = tree_shardings(model.logical_axes, mesh, rules, shapes)
    mc = model.config
    kv_shape = (mc.num_kv_heads, config.num_pages, config.page_size, mc.head_dim)
    kv_sharding = jax.sharding.NamedSharding(
      mesh, logical_to_pspec(("kv_heads", None, None, "head_dim"), rules, mesh, kv_shape)
    )
    zeros = jax.jit(lambda: jnp.zeros(kv_shape, jnp.dtype(mc.dtype)), out_shardings=kv_sharding)
    self._new_kv = lambda: [(zeros(), zeros()) for _ in range(mc.num_layers)]
    self._kv = self._new_kv()  # None while released (`release_memory`)
    self._precompiled = False
    self._row_sharding = batch_sharding(mesh, rules, 1)
    self._matrix_sharding = batch_sharding(mesh, rules, 2)
    batch_axes = self._row_sharding.spec[0] or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    self._row_multiple = int(np.prod([mesh.shape[a] for a in batch_axes]))
    self.allocator = PageAllocator(config.num_pages)
    self.waiting: collections.deque[RequestRecord] = collections.deque()
    self.running: dict[str, _Running] = {}
    self._admissions = itertools.count()
    self._ids = itertools.count()
    self.num_preemptions = 0
    # Host arrays go straight into the jitted call with their shardings declared: jit's own
    # transfer is about 10x cheaper per array than a separate device_put (which was most of
    # the host time of a small model's decode step). Params and caches keep their placement.
    params_kv = (self.param_shardings, [(kv_sharding, kv_sharding)] * mc.num_layers)
    row, matrix = self._row_sharding, self._matrix_sharding
    # One jitted decode per window size (powers of two below decode_steps, and decode_steps).
    self._decoders = {}
    self._decode_shardings = (*params_kv, row, row, matrix, row, row, row, row, row, row, matrix)
    self._prefill = jax.jit(
      self._prefill_impl, donate_argnums=(1,), in_shardings=(*params_kv, matrix, matrix, matrix)
    )

  # -- requests ----------------------------------------------------------------------------------

  def update_weights(self, params: Params, version: int) -> None:
    """New weights take effect at the next decode window; later tokens carry `version`."""
    self.params = place_params(params, self.param_shardings, self.model.abstract_params())
    self.version = version
    if self._kv is None:
      self._kv = self._new_kv()
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
    self.params = None
    self._kv = None

  def precompile(
    self, stop_widths: Sequence[int] = (1,), filtering: Sequence[bool] = (False, True)
  ) -> int:
    """Compiles every decode window and prefill call this engine can make, by running each
    shape once on padding rows (position -1: they read and write no cache), so that none
    compiles mid-run. `stop_widths`: the stop-id list widths to cover (1: the end token only);
    `filtering`: the sampler variants to cover (with and without top-k/top-p rows).
    Needs weights. Returns the number of shapes run."""
    if self.params is None:
      raise ValueError("PagedEngine.precompile needs weights first: call update_weights.")
    cfg, mc = self.cfg, self.model.config
    row_counts = sorted({self._rows(n) for n in range(1, cfg.max_running + 1)})
    max_pages = pages_for(mc.max_seq_len, cfg.page_size)
    widths = sorted({bucket(p, 1) for p in range(1, max_pages + 1)})
    windows = sorted({min(cfg.decode_steps, bucket(w, 1)) for w in range(1, cfg.decode_steps + 1)})
    chunks = sorted({bucket(c) for c in range(1, cfg.prefill_chunk + 1)})
    shapes = 0
    for rows, width in itertools.product(row_counts, widths):
      table = np.zeros((rows, width), np.int32)
      pad_rows = np.full((rows,), -1, np.int32)
      for window, stops, filters in itertools.product(windows, stop_widths, filtering):
        out = self._decoder(window, filters)(
          self.params, self._kv, np.zeros((rows,), np.int32), pad_rows, table,
          np.zeros((rows,), np.int32), np.zeros((rows,), np.uint32), np.zeros((rows,), np.int32),
          np.ones((rows,), np.float32), np.zeros((rows,), np.int32), np.ones((rows,), np.float32),
          np.full((rows, stops), -1, np.int32),
        )  # fmt: skip
        self._kv = out[-1]
        shapes += 1
      for chunk in chunks:
        tokens = np.full((rows, chunk), self.pad_id, np.int32)
        positions = np.full((rows, chunk), -1, np.int32)
        self._kv, _ = self._prefill(self.params, self._kv, tokens, positions, table)
        shapes += 1
    jax.block_until_ready(self._kv)
    self._precompiled = True
    return shapes

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
    if rid in self.running or any(r.request_id == rid for r in self.waiting):
      raise ValueError(f"Request id {rid} is already in this engine.")
    if not record.prompt_ids:
      raise ValueError(f"Request {rid} has an empty prompt; give it at least one token.")
    if len(record.prompt_ids) > limit:
      raise ValueError(
        f"Request {rid}: prompt of {len(record.prompt_ids)} tokens exceeds the "
        f"model's max_seq_len={limit}; shorten the prompt."
      )
    longest = min(len(record.prompt_ids) + record.sampling.max_new_tokens, limit)
    if pages_for(longest, self.cfg.page_size) > self.cfg.num_pages:
      raise ValueError(
        f"Request {rid} may reach {longest} tokens = {pages_for(longest, self.cfg.page_size)} "
        f"pages of {self.cfg.page_size}, more than the page budget of {self.cfg.num_pages}; "
        "raise rollout.paged.num_pages or lower max_new_tokens."
      )

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def snapshot(self, request_id: str) -> RequestRecord:
    """Stops a request and returns its record; `submit` it on any engine to continue."""
    return self.abort([request_id])[0]

  def abort(self, request_ids: Sequence[str]) -> list[RequestRecord]:
    """Removes requests (running or waiting) and returns their partial records."""
    out = []
    for rid in request_ids:
      if rid in self.running:
        state = self.running.pop(rid)
        self.allocator.free(state.pages)
        out.append(state.record)
        continue
      match = [r for r in self.waiting if r.request_id == rid]
      if not match:
        raise KeyError(f"Request {rid} is not running or waiting in this engine.")
      self.waiting.remove(match[0])
      out.append(match[0])
    return out

  # -- the loop ----------------------------------------------------------------------------------

  def step(self) -> list[RequestRecord]:
    """Admits what fits, runs one decode window (up to `decode_steps` tokens for every running
    request); returns the requests that finished."""
    if self.params is None:
      raise RuntimeError("PagedEngine.step called before update_weights gave it weights.")
    self._admit()
    if not self.running:
      if self.waiting:
        raise RuntimeError("No request fits the free pages although none is running.")
      return []
    window = self._window()
    self._grow_pages(window)
    return self._decode_window(window)

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
    admitted = []
    while self.waiting and len(self.running) < self.cfg.max_running:
      record = self.waiting[0]
      pages = self.allocator.allocate(pages_for(record.num_tokens, self.cfg.page_size))
      if pages is None:
        break
      self.waiting.popleft()
      state = _Running(record, pages, next(self._admissions))
      self.running[record.request_id] = state
      admitted.append(state)
    if admitted:
      self._prefill_states(admitted)

  def _budget(self, record: RequestRecord) -> int:
    """Tokens the request may still generate before its length limit."""
    return min(
      record.sampling.max_new_tokens - len(record.token_ids),
      self.model.config.max_seq_len - record.num_tokens,
    )

  def _window(self) -> int:
    """Steps of the next device call: enough for the longest budget, bucketed, capped."""
    longest = max(self._budget(s.record) for s in self.running.values())
    return min(self.cfg.decode_steps, bucket(longest, 1))

  def _grow_pages(self, window: int) -> None:
    """Gives every running request pages for the tokens its window will cache, preempting the
    youngest when pages run out. A window caches the request's last token and the tokens it
    samples but the final one."""
    for state in sorted(self.running.values(), key=lambda s: s.admitted):
      if state.record.request_id not in self.running:
        continue  # preempted below while serving an older request
      r = state.record
      cached = r.num_tokens - 1 + min(window, self._budget(r))
      need = pages_for(cached, self.cfg.page_size) - len(state.pages)
      while need > 0:
        pages = self.allocator.allocate(need)
        if pages is not None:
          state.pages.extend(pages)
          break
        youngest = max(self.running.values(), key=lambda s: s.admitted)
        self._preempt(youngest)
        if youngest is state:
          break

  def _preempt(self, state: _Running) -> None:
    del self.running[state.record.request_id]
    self.allocator.free(state.pages)
    self.waiting.appendleft(state.record)
    self.num_preemptions += 1

  # -- device calls ------------------------------------------------------------------------------

  def _page_table(self, states: Sequence[_Running], rows: int) -> np.ndarray:
    width = bucket(max(len(s.pages) for s in states), 1)
    table = np.zeros((rows, width), np.int32)
    for i, s in enumerate(states):
      table[i, : len(s.pages)] = s.pages
    return table

  def _rows(self, n: int) -> int:
    return -(-bucket(n, 1) // self._row_multiple) * self._row_multiple

  def _prefill_states(self, states: Sequence[_Running]) -> None:
    """Caches every token but the last of each admitted request, chunk by chunk."""
    seqs = [s.record.prompt_ids + s.record.token_ids for s in states]
    longest = max(len(x) for x in seqs) - 1
    chunk = self.cfg.prefill_chunk
    for start in range(0, longest, chunk):
      live = [(s, x) for s, x in zip(states, seqs, strict=True) if start < len(x) - 1]
      rows, width = self._rows(len(live)), bucket(min(chunk, longest - start))
      tokens = np.full((rows, width), self.pad_id, np.int32)
      positions = np.full((rows, width), -1, np.int32)
      for i, (_, x) in enumerate(live):
        part = x[start : min(start + chunk, len(x) - 1)]
        tokens[i, : len(part)] = part
        positions[i, : len(part)] = np.arange(start, start + len(part))
      table = self._page_table([s for s, _ in live], rows)
      self._kv, routing_btlk = self._prefill(self.params, self._kv, tokens, positions, table)
      if routing_btlk is not None:
        self._record_prompt_routing([s.record for s, _ in live], start, np.asarray(routing_btlk))

  @staticmethod
  def _record_prompt_routing(records, start: int, routing_btlk: np.ndarray) -> None:
    """Keeps the routes of prompt tokens not yet traced (a re-prefill after preemption re-routes
    tokens whose routes were recorded when they were first processed; those are kept)."""
    for i, r in enumerate(records):
      first, stop = len(r.prompt_routing), len(r.prompt_ids) - 1
      for position in range(max(first, start), min(stop, start + routing_btlk.shape[1])):
        r.prompt_routing.append(routing_btlk[i, position - start].tolist())

  def _decode_window(self, window: int) -> list[RequestRecord]:
    states = sorted(self.running.values(), key=lambda s: s.admitted)
    rows = self._rows(len(states))
    stops = [self._stop_ids(s.record) for s in states]
    tokens = np.full((rows,), self.pad_id, np.int32)
    positions = np.full((rows,), -1, np.int32)
    budgets = np.zeros((rows,), np.int32)  # padding rows take no step
    seeds = np.zeros((rows,), np.uint32)
    index = np.zeros((rows,), np.int32)
    temperature = np.ones((rows,), np.float32)
    top_k = np.zeros((rows,), np.int32)
    top_p = np.ones((rows,), np.float32)
    stop_ids = np.full((rows, bucket(max(map(len, stops)), 1)), -1, np.int32)
    for i, s in enumerate(states):
      r = s.record
      tokens[i] = r.token_ids[-1] if r.token_ids else r.prompt_ids[-1]
      positions[i] = r.num_tokens - 1
      budgets[i] = self._budget(r)
      seeds[i], index[i] = r.seed, len(r.token_ids)
      temperature[i], top_k[i], top_p[i] = (
        r.sampling.temperature,
        r.sampling.top_k,
        r.sampling.top_p,
      )
      stop_ids[i, : len(stops[i])] = stops[i]
    table = self._page_table(states, rows)
    filtering = needs_filter(s.record.sampling for s in states)
    tokens_wb, logprobs_wb, routing_wblk, taken_b, self._kv = self._decoder(window, filtering)(
      self.params,
      self._kv,
      tokens,
      positions,
      table,
      budgets,
      seeds,
      index,
      temperature,
      top_k,
      top_p,
      stop_ids,
    )
    tokens_wb, logprobs_wb = np.asarray(tokens_wb), np.asarray(logprobs_wb)
    taken_b = np.asarray(taken_b)
    routing_wblk = None if routing_wblk is None else np.asarray(routing_wblk)
    finished = []
    for i, s in enumerate(states):
      r = s.record
      for j in range(int(taken_b[i])):
        token = int(tokens_wb[j, i])
        r.token_ids.append(token)
        r.logprobs.append(float(logprobs_wb[j, i]))
        r.versions.append(self.version)
        if routing_wblk is not None:
          r.routing.append(routing_wblk[j, i].tolist())
        if token in stops[i]:
          r.finish_reason = "stop"
        elif self._budget(r) <= 0:
          r.finish_reason = "length"
      if r.finish_reason:
        del self.running[r.request_id]
        self.allocator.free(s.pages)
        finished.append(r)
    return finished

  def _stop_ids(self, record: RequestRecord) -> tuple[int, ...]:
    eos = () if record.sampling.ignore_eos else (self.eos_id,)
    return eos + tuple(record.sampling.stop_token_ids)

  def _decoder(self, steps: int, filtering: bool):
    """The jitted window of `steps` decode steps; `filtering`: some row uses top-k/top-p."""
    key = (steps, filtering)
    if key not in self._decoders:
      self._decoders[key] = jax.jit(
        functools.partial(self._decode_impl, steps=steps, filtering=filtering),
        donate_argnums=(1,),
        in_shardings=self._decode_shardings,
      )
    return self._decoders[key]

  def _layers(self, kv, table):
    return tuple(PagedLayerCache(k, v, table) for k, v in kv)

  def _prefill_impl(self, params, kv, tokens_bt, positions_bt, table_bn):
    _, cache, routing_btlk = self.model.apply(
      params,
      tokens_bt,
      positions_bt,
      self._layers(kv, table_bn),
      return_routing=True,
      moe=self._moe,
    )
    return [(c.k_pages_kpze, c.v_pages_kpze) for c in cache], routing_btlk

  def _decode_impl(
    self,
    params,
    kv,
    tokens_b,
    positions_b,
    table_bn,
    budgets_b,
    seeds_b,
    index_b,
    temperature_b,
    top_k_b,
    top_p_b,
    stop_ids_bs,
    *,
    steps: int,
    filtering: bool,
  ):
    """`steps` decode steps; a row takes at most its budget and stops after a stop token.

    Returns per step the sampled tokens, their log-probs and routes ([steps, b, ...]; a row's
    entries after it stopped are junk), the steps each row took, and the caches.
    """

    def one_step(carry, j):
      kv, tokens_b, taken_b, live_b = carry
      positions_j = jnp.where(live_b, positions_b + j, -1)  # stopped rows write nothing
      logits_b1v, cache, routing_b1lk = self.model.apply(
        params,
        tokens_b[:, None],
        positions_j[:, None],
        self._layers(kv, table_bn),
        return_routing=True,
        moe=self._moe,
      )
      keys_b = jax.vmap(_token_key)(seeds_b, index_b + j)
      new_b, logprobs_b = sample_tokens(
        keys_b, logits_b1v[:, 0], temperature_b, top_k_b, top_p_b, filtering=filtering
      )
      taken_b = taken_b + live_b
      stopped_b = jnp.any(new_b[:, None] == stop_ids_bs, axis=1) | (taken_b >= budgets_b)
      kv = [(c.k_pages_kpze, c.v_pages_kpze) for c in cache]
      routing_blk = None if routing_b1lk is None else routing_b1lk[:, 0]
      carry = (kv, jnp.where(live_b, new_b, tokens_b), taken_b, live_b & ~stopped_b)
      return carry, (new_b, logprobs_b, routing_blk)

    init = (kv, tokens_b, jnp.zeros_like(budgets_b), budgets_b > 0)
    (kv, _, taken_b, _), (tokens_wb, logprobs_wb, routing_wblk) = jax.lax.scan(
      one_step, init, jnp.arange(steps, dtype=jnp.int32)
    )
    return tokens_wb, logprobs_wb, routing_wblk, taken_b, kv


def _token_key(seed, index):
  """The key of token `index` of the request with `seed`: independent of batching."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), index)


def record_completion(record: RequestRecord) -> Completion:
  """The `Completion` of a finished record (arrays, routing reshaped), as the learner takes it."""
  routing = prompt_routing = None
  if record.routing:
    routing = np.asarray(record.routing, np.int32)
    prompt_routing = np.asarray(record.prompt_routing, np.int32).reshape(-1, *routing.shape[1:])
  return Completion(
    prompt_ids=list(record.prompt_ids),
    token_ids=np.asarray(record.token_ids, np.int32),
    logprobs=np.asarray(record.logprobs, np.float32),
    versions=np.asarray(record.versions, np.int32),
    finish_reason=record.finish_reason,
    routing=routing,
    prompt_routing=prompt_routing,
  )
