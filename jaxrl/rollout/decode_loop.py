"""The device side of the paged engine's decode loop: per-row state that stays on the device.

Each row (slot) of the running batch has its decode state on the device: the token to feed
next, the position it is written at, the steps it may still take, the index of the next
sampled token (for its sampling key) and whether it is live. A window of decode steps reads the
state and returns the advanced state, so consecutive windows chain on the device without the
host: the host only admits new requests into free rows (`set_rows`), moves rows when the batch
grows or shrinks (`gather_rows`) and reads tokens back, one window behind.

The row updates are programs of their own, few and fixed for an engine, so that a precompiled
engine compiles none mid-run (`precompile.engine_programs`): a `set_rows` per row count and
stop-id width (every update of a row count has an entry for every row), and a re-layout
through the engine's largest row count, so a `gather_rows` into and out of it per row count
(not one per pair of row counts).

Glossary: b rows, w window steps, s stop ids per row, l layers, k experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout.engine import bucket
from jaxrl.rollout.sampling import VocabSplit, sample_tokens


class DecodeState(NamedTuple):
  """What changes from step to step, per row; a dead row (`live_b` False) writes nothing."""

  tokens_b: jax.Array  # int32: the token the next step feeds (cached, then sampled after)
  positions_b: jax.Array  # int32: the position that token is cached at
  budgets_b: jax.Array  # int32: steps the row may still take
  index_b: jax.Array  # int32: index of the next sampled token in its response
  live_b: jax.Array  # bool


class RowSampling(NamedTuple):
  """What stays fixed while a row runs: its sampling key seed, parameters and stop ids."""

  seeds_b: jax.Array  # uint32
  temperature_b: jax.Array  # float32
  top_k_b: jax.Array  # int32
  top_p_b: jax.Array  # float32
  stop_ids_bs: jax.Array  # int32, -1 pads


class WindowOutput(NamedTuple):
  """Per step of a window: sampled tokens, their log-probs and MoE routes ([w, b, ...]; a row's
  entries after it stopped are junk), and the steps each row took."""

  tokens_wb: jax.Array
  logprobs_wb: jax.Array
  routing_wblk: jax.Array | None
  taken_b: jax.Array


# Stop-id rows are at least this wide: a request's end token and the stop ids of common chat
# tokenizers (Qwen's <|im_end|> and <|endoftext|>, Llama 3's three) and a stop string or two
# share one width, so that the stop ids a run's tokenizer brings compile no decode window of
# another width mid-run; the comparison against 4 ids instead of 1 costs the step nothing.
MIN_STOP_WIDTH = 4


def stop_width(stop_ids: int) -> int:
  """The stop-id row width of `stop_ids` ids: a power of two, at least `MIN_STOP_WIDTH`."""
  return bucket(stop_ids, MIN_STOP_WIDTH)


def dead_rows(rows: int, stop_width: int, pad_id: int):
  """Numpy arrays of `rows` dead rows: (DecodeState, RowSampling)."""
  state = DecodeState(
    np.full((rows,), pad_id, np.int32),
    np.full((rows,), -1, np.int32),
    np.zeros((rows,), np.int32),
    np.zeros((rows,), np.int32),
    np.zeros((rows,), bool),
  )
  sampling = RowSampling(
    np.zeros((rows,), np.uint32),
    np.ones((rows,), np.float32),
    np.zeros((rows,), np.int32),
    np.ones((rows,), np.float32),
    np.full((rows, stop_width), -1, np.int32),
  )
  return state, sampling


def token_key(seed, index):
  """The key of token `index` of the request with `seed`: independent of batching."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), index)


def decode_window(
  step_logits,
  kv,
  state: DecodeState,
  sampling: RowSampling,
  *,
  steps: int,
  filter_width: int,
  vocab_split: VocabSplit | None = None,
):
  """`steps` decode steps from `state`; returns (WindowOutput, the advanced state, kv).
  `vocab_split`: where the logits split over their vocabulary (`sample_tokens`).

  `step_logits(kv, tokens_b, positions_b) -> (logits_bv, routing_blk or None, kv)` runs the
  model for one token per row (position -1: nothing cached, output ignored). A row takes at most
  its budget and stops after a stop token; the state it ends in feeds the next window.
  """

  def one_step(carry, j):
    kv, tokens_b, taken_b, live_b = carry
    positions_b = jnp.where(live_b, state.positions_b + j, -1)  # stopped rows write nothing
    logits_bv, routing_blk, kv = step_logits(kv, tokens_b, positions_b)
    keys_b = jax.vmap(token_key)(sampling.seeds_b, state.index_b + j)
    new_b, logprobs_b = sample_tokens(
      keys_b,
      logits_bv,
      sampling.temperature_b,
      sampling.top_k_b,
      sampling.top_p_b,
      filter_width=filter_width,
      vocab_split=vocab_split,
    )
    taken_b = taken_b + live_b
    stopped_b = jnp.any(new_b[:, None] == sampling.stop_ids_bs, axis=1) | (
      taken_b >= state.budgets_b
    )
    carry = (kv, jnp.where(live_b, new_b, tokens_b), taken_b, live_b & ~stopped_b)
    return carry, (new_b, logprobs_b, routing_blk)

  live_b = state.live_b & (state.budgets_b > 0)
  init = (kv, state.tokens_b, jnp.zeros_like(state.budgets_b), live_b)
  (kv, tokens_b, taken_b, live_b), (tokens_wb, logprobs_wb, routing_wblk) = jax.lax.scan(
    one_step, init, jnp.arange(steps, dtype=jnp.int32)
  )
  advanced = DecodeState(
    tokens_b,
    state.positions_b + taken_b,
    state.budgets_b - taken_b,
    state.index_b + taken_b,
    live_b,
  )
  return WindowOutput(tokens_wb, logprobs_wb, routing_wblk, taken_b), advanced, kv


def block_order(shard_of: Sequence[int], shards: int, rows: int) -> list[int | None]:
  """Rows of a call laid out in `shards` equal blocks, one for each device along the rows'
  axes: item i (of shard `shard_of[i]`) in its shard's block, in order; None: a padding row.
  Raises where a shard has more items than its block has rows."""
  block = rows // shards
  order: list[int | None] = [None] * rows
  taken = [0] * shards
  for i, shard in enumerate(shard_of):
    if taken[shard] == block:
      raise ValueError(f"block_order: shard {shard} has more than its {block} rows.")
    order[shard * block + taken[shard]] = i
    taken[shard] += 1
  return order


def set_rows(state: DecodeState, sampling: RowSampling, rows_a, new_state, new_sampling):
  """Rows `rows_a` of (state, sampling) replaced by the new rows; indices out of range (the
  padding of a bucketed update) change nothing."""
  put = lambda x, v: x.at[rows_a].set(v.astype(x.dtype), mode="drop")  # noqa: E731
  return jax.tree.map(put, state, new_state), jax.tree.map(put, sampling, new_sampling)


def gather_rows(state: DecodeState, sampling: RowSampling, source_b, dead_state, dead_sampling):
  """A new row layout: row i is old row `source_b[i]`, or a dead row where it is -1 (the batch
  grows, shrinks or is reordered without reading the state back)."""

  def take(x, dead):
    padded = jnp.concatenate([x, dead.astype(x.dtype)], axis=0)
    return padded[jnp.where(source_b >= 0, source_b, x.shape[0])]

  return jax.tree.map(take, state, dead_state), jax.tree.map(take, sampling, dead_sampling)


class RowStart(NamedTuple):
  """Where a request's decode starts: its row state and sampling (host scalars and stop ids)."""

  token: int
  position: int
  budget: int
  index: int
  seed: int
  temperature: float
  top_k: int
  top_p: float
  stop_ids: tuple[int, ...]


class DeviceBatch:
  """The rows of the running batch: which request each row holds (`rows`, on the host; None is
  a free row) and their decode state and sampling parameters (`state`, `sampling`, on the
  device, None before the first admission). A holder is any object with a `row` attribute,
  which this keeps up to date, and a `shard`: the rows split into `shards` equal blocks, in
  order (those of each device along the rows' axes), and a holder's row is always in its
  shard's block, where its KV pages are (`PagedCalls.page_shards`)."""

  def __init__(
    self,
    shardings: tuple[DecodeState, RowSampling],
    pad_id: int,
    *,
    max_rows: int,
    put=jax.device_put,
    shards: int = 1,
    note=lambda jitted, args: None,
  ):
    """`max_rows`: the largest row count the batch takes, which re-layouts pass through;
    `put(tree, shardings)`: host arrays onto the devices (`PagedCalls.put`); `note(jitted,
    args)`: told of each row update run (`PagedCalls.note`, the engine's count of shapes)."""
    self.rows: list = []
    self.state: DecodeState | None = None
    self.sampling: RowSampling | None = None
    self._shardings = shardings
    self._pad_id = pad_id
    self._put = put
    self.shards = shards
    self.max_rows = max_rows
    # Declared output shardings: the state keeps the layout the decoders expect.
    self._set_rows = jax.jit(set_rows, out_shardings=shardings)
    self._gather_rows = jax.jit(gather_rows, out_shardings=shardings)
    self._note = note

  def _update(self, jitted, *args) -> None:
    """The row state and sampling through `jitted` (a row update) with `args`, noted."""
    self._note(jitted, (self.state, self.sampling, *args))
    self.state, self.sampling = jitted(self.state, self.sampling, *args)

  @property
  def stop_width(self) -> int:
    return self.sampling.stop_ids_bs.shape[1]

  def place(self, keep: list, new: list[tuple[object, RowStart]], rows: int, stop_width: int):
    """Gives each new holder a free row of its shard and writes its start there; `keep` are
    the holders that stay. A batch whose row count changes is re-laid out first (kept rows to
    the front of their shard's block, in order), all on the device; stop-id rows widen to
    `stop_width` when it grows."""
    if rows % self.shards:
      raise ValueError(f"DeviceBatch: {rows} rows do not split into {self.shards} shards.")
    if self.state is None:
      self.state, self.sampling = self._put(
        dead_rows(rows, stop_width, self._pad_id), self._shardings
      )
      self.rows = [None] * rows
    elif stop_width > self.stop_width:
      pad = ((0, 0), (0, stop_width - self.stop_width))
      widened = jnp.pad(self.sampling.stop_ids_bs, pad, constant_values=-1)  # -1 stops nothing
      self.sampling = self.sampling._replace(stop_ids_bs=widened)
    if rows != len(self.rows):
      self._relayout(keep, rows)
    block = rows // self.shards
    free = [
      iter(i for i in range(s * block, (s + 1) * block) if self.rows[i] is None)
      for s in range(self.shards)
    ]
    index, state, sampling = self._row_update()
    for i, (holder, start) in enumerate(new):
      row = next(free[holder.shard], None)
      if row is None:
        raise ValueError(f"DeviceBatch: no free row in shard {holder.shard}'s {block} rows.")
      holder.row = index[i] = row
      self.rows[holder.row] = holder
      state.tokens_b[i], state.positions_b[i] = start.token, start.position
      state.budgets_b[i], state.index_b[i], state.live_b[i] = start.budget, start.index, True
      sampling.seeds_b[i], sampling.temperature_b[i] = start.seed, start.temperature
      sampling.top_k_b[i], sampling.top_p_b[i] = start.top_k, start.top_p
      sampling.stop_ids_bs[i, : len(start.stop_ids)] = start.stop_ids
    self._update(self._set_rows, index, state, sampling)

  def kill(self, row: int) -> None:
    """Frees a row and stops it on the device (a row that stopped there needs only `free`)."""
    self.rows[row] = None
    index, state, sampling = self._row_update()
    index[0] = row
    self._update(self._set_rows, index, state, sampling)

  def _row_update(self):
    """(index, state, sampling) of a row update that changes nothing yet: dead rows, each
    aimed out of range (dropped). It has an entry for every row of the batch, however few it
    writes, so that one program serves every admission and kill of a row count and stop
    width (sized to the rows written, they compiled new shapes mid-run)."""
    rows = len(self.rows)
    state, sampling = dead_rows(rows, self.stop_width, self._pad_id)
    return np.full((rows,), rows, np.int32), state, sampling

  def free(self, row: int) -> None:
    self.rows[row] = None

  def _relayout(self, keep: list, rows: int) -> None:
    """Moves the kept holders to their rows in a batch of `rows` rows. Between two row counts
    below `max_rows` the rows pass through `max_rows` rows unmoved (two gathers): each row
    count then has a program into and out of the largest, where a gather straight from one
    count to another would be a program per pair."""
    if rows > self.max_rows:
      raise ValueError(f"DeviceBatch: {rows} rows are more than its max_rows={self.max_rows}.")
    source = np.full((rows,), -1, np.int32)
    moved: list = [None] * rows
    for i, k in enumerate(block_order([h.shard for h in keep], self.shards, rows)):
      if k is not None:
        holder = keep[k]
        source[i], moved[i], holder.row = holder.row, holder, i
    dead = dead_rows(1, self.stop_width, self._pad_id)
    if self.max_rows not in (rows, len(self.rows)):
      unmoved = np.arange(self.max_rows, dtype=np.int32)
      self._update(self._gather_rows, np.where(unmoved < len(self.rows), unmoved, -1), *dead)
    self._update(self._gather_rows, source, *dead)
    self.rows = moved
