"""Admission: the paged engine's waiting requests into rows and pages (`admit_waiting`).

A request reuses the pages of a leader (`PagedConfig.share_prefix`: admitted in the same call
with the same tokens, prefilled once) or its own parked ones (`kv_park`: its last turn's; only
the tokens after them are prefilled): full pages shared, the page its first write falls in
copied. A ring of the window pool (`window_kv`) is a kept turn's own, and a leader's copied
whole.

On an engine whose rows and pages split over several devices (`PagedEngine.shards`), a request
runs on one shard: its row in that shard's block of the batch, its pages in that shard's part
of the pool. It goes to a leader's shard or its parked pages' where that has a free row and
the pages, else to the shard with the fewest running requests (then the most free pages) that
has room, prefilled whole there; it then leads the requests with its tokens that come to that
shard after it (a GRPO group split over shards prefills its prompt once on each).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, NamedTuple

from jaxrl.rollout.kv_park import Parked
from jaxrl.rollout.requests import RequestRecord, pages_for

if TYPE_CHECKING:
  from jaxrl.rollout.paged import PagedEngine


@dataclasses.dataclass
class Running:
  """A request in the engine's running batch: its record, its KV pages and where it runs."""

  record: RequestRecord
  pages: list[int]
  admitted: int  # admission order; the highest is the youngest
  version: int  # the weights its prefill ran under: only pages of the current ones are parked
  row: int = -1  # its row in the device batch
  pending: int = 0  # steps of the window in flight: at most this many tokens not yet read back
  ring: list[int] = dataclasses.field(default_factory=list)  # its window pool pages (window_kv)
  shard: int = 0  # the devices of its row and pages (`PagedCalls.page_shards`)


class _Claim(NamedTuple):
  """Where a request was given room: its shard, the leader or parked entry whose pages it
  reuses (at most one; None: prefilled whole), the tokens those pages hold for it (`reused`),
  its own new pages and its ring (`window_kv`; empty without one)."""

  shard: int
  leader: Running | None
  kept: Parked | None
  reused: int
  own: list[int]
  ring: list[int]


def admit_waiting(engine: PagedEngine) -> None:
  """Admits waiting requests, in order, while rows and pages last; prefills them (`prefill`)
  and gives them rows of the device batch. A part of `PagedEngine`, apart for its length."""
  admitted, leaders, z = [], {}, engine.cfg.page_size
  kept_copies, leader_copies = [], []  # partial pages: copied before / after the prefill
  ring_copies = []  # leaders' rings into their followers', after the prefill
  running_on = collections.Counter(s.shard for s in engine.running.values())
  while engine.waiting and len(engine.running) < engine.cfg.max_running:
    record = engine.waiting[0]
    tokens = tuple(record.prompt_ids + record.token_ids)
    # Its leader on each shard that has one (a request prefilled on a shard leads there).
    shard_leaders = leaders.get(tokens, {}) if engine.cfg.share_prefix else {}
    kept = engine.park.take(record.request_id, tokens)
    claim = _claim(engine, tokens, list(shard_leaders.values()), kept, running_on)
    if claim is None:
      if kept is not None and not engine.running:
        # Only its own parked pages stand in the way (the page past the shared ones is held
        # until after the allocation): drop them and prefill it whole.
        engine.park.free(kept)
        continue
      if kept is not None:
        engine.park.park(record.request_id, kept)
      break
    engine.waiting.popleft()
    source = claim.leader.pages if claim.leader else claim.kept.pages if claim.kept else []
    full = claim.reused // z
    pages = engine.allocator.share(source[:full]) + claim.own
    if claim.reused % z:
      copies = leader_copies if claim.leader is not None else kept_copies
      copies.append((source[full], claim.own[0]))
    if claim.leader is not None and claim.ring:
      ring_copies.extend(zip(claim.leader.ring, claim.ring, strict=True))
    if kept is not None:
      if claim.ring is kept.ring:
        engine.allocator.free(kept.pages)  # after `share`: the pages it reuses stay allocated
      else:
        engine.park.free(kept)
      if claim.leader is None and claim.kept is not None:
        record.prompt_routing += kept.prompt_routes(record, claim.reused)
        engine.num_kept_prefill_tokens += claim.reused
    state = Running(
      record, pages, next(engine._admissions), engine.version, ring=claim.ring, shard=claim.shard
    )
    engine.running[record.request_id] = state
    running_on[claim.shard] += 1
    admitted.append((state, claim.leader, claim.reused))
    leaders.setdefault(tokens, {}).setdefault(claim.shard, state)
  if admitted:
    engine._compile_ahead([s for s, _, _ in admitted])
    engine._kv = engine._calls.copy(engine._kv, kept_copies)
    fresh = [(s, reused) for s, leader, reused in admitted if leader is None]
    engine._prefill_states([s for s, _ in fresh], [reused for _, reused in fresh])
    engine._kv = engine._calls.copy(engine._kv, leader_copies, ring_copies)
    for state, leader, reused in admitted:
      if leader is not None:  # the routes its record came with stay (a later turn's)
        own = state.record.prompt_routing
        state.record.prompt_routing = own + [
          list(x) for x in leader.record.prompt_routing[len(own) :]
        ]
        engine.num_shared_prefill_tokens += reused
    engine._place([s for s, _, _ in admitted])


def _claim(
  engine: PagedEngine, tokens: tuple[int, ...], leaders: list, kept: Parked | None, running_on
) -> _Claim | None:
  """Pages (and a ring) for a request of `tokens` on the first shard that has a free row and
  room, reusing a leader's pages there (`leaders`: one a shard, the first admitted first),
  else its parked ones, else none; None when no shard has room (nothing taken, though parked
  entries of other requests may have been evicted)."""
  z, park = engine.cfg.page_size, engine.park
  kept_shard = park.shard_of(kept) if kept is not None else -1
  candidates = [(leader.shard, leader, None, len(tokens) - 1) for leader in leaders]
  if kept is not None:
    candidates.append((kept_shard, None, kept, min(len(kept.tokens), len(tokens) - 1)))
  by_load = sorted(
    range(engine.shards), key=lambda s: (running_on[s], -engine.allocator.free_in(s), s)
  )
  candidates += [(s, None, None, 0) for s in by_load]
  for shard, source_leader, source_kept, reused in candidates:
    if running_on[shard] >= engine.rows_per_shard:
      continue
    own = park.allocate(pages_for(len(tokens), z) - reused // z, shard)
    if own is None:
      continue
    ring = []
    if engine.ring_pages:
      # Its parked ring where it runs on its parked pages' shard (a leader's is copied into it).
      ring = kept.ring if kept_shard == shard else park.allocate_ring(engine.ring_pages, shard)
      if ring is None:  # every ring of the shard is a running request's
        engine.allocator.free(own)
        continue
    return _Claim(shard, source_leader, source_kept, reused, own, ring)
  return None
