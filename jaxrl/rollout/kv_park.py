"""KV pages kept after a request finishes, for its next turn (multi-turn RL, issue 18).

A multi-turn trajectory's next model turn is a new request with the same id whose prompt is
the whole trajectory so far: the finished turn's tokens plus the environment's answer. Between
the two, the environment runs and the request holds no decode row. Its pages are parked here
under its id, with the tokens whose keys/values they hold, so that the next turn reuses them
(`PagedEngine._admit`) and prefills only the answer instead of the whole trajectory.

Parked pages are a cache, never a reservation: the engine evicts entries, least recently parked
first, before it refuses an admission or preempts a running request. Keys/values depend only
on the tokens and the weights, so an entry is reused only when the new request's tokens start
with the parked ones, and every entry is dropped when the weights change. On an engine whose
pool splits into shards (`PageAllocator`), an entry's pages are on one shard, and only entries
of the shard that is short of pages are evicted. An engine with a
pool for its sliding-window layers (`window_kv`) parks the request's ring with its pages.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxrl.rollout.requests import PageAllocator, RequestRecord, pages_for


@dataclasses.dataclass
class Parked:
  """A finished request's cache: `pages` hold the keys/values of `tokens` (positions 0..len-1,
  `page_size` to a page); `routes` (MoE only, else empty) are the expert ids each layer chose
  for each of those tokens, which a reusing request's prompt routing takes over; `ring`: its
  pages of the window pool (empty without one), which hold its last positions."""

  tokens: tuple[int, ...]
  pages: list[int]
  routes: list[list[list[int]]]
  ring: list[int] = dataclasses.field(default_factory=list)

  def prompt_routes(self, record: RequestRecord, reused: int) -> list[list[list[int]]]:
    """MoE: the routes of `record`'s prompt tokens among the first `reused` that its prompt
    routing lacks (what a prefill of them would have recorded)."""
    return self.routes[len(record.prompt_routing) : min(reused, len(record.prompt_ids) - 1)]


class KVPark:
  """Parked entries by request id, in the order they were parked (the oldest evicted first).
  Each entry holds one reference to each of its pages (`PageAllocator.share` semantics): pages
  still shared with a running request (a common prompt prefix) stay allocated when it goes.
  `ring_allocator`: the window pool's (`window_kv`), None without one."""

  def __init__(self, allocator: PageAllocator, ring_allocator: PageAllocator | None = None):
    self.allocator = allocator
    self.ring_allocator = ring_allocator
    self._entries: collections.OrderedDict[str, Parked] = collections.OrderedDict()
    self.num_evicted_pages = 0  # pages given up under memory pressure (not by drop/clear)

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, request_id: str) -> bool:
    return request_id in self._entries

  @property
  def num_pages(self) -> int:
    """Page references held in the main pool (a page shared by two entries counts twice)."""
    return sum(len(e.pages) for e in self._entries.values())

  def park(self, request_id: str, entry: Parked) -> None:
    """Keeps `entry` (its page references move here) as the most recent; replaces any older
    entry of the same id."""
    self.drop(request_id)
    self._entries[request_id] = entry

  def keep(self, record: RequestRecord, pages: list[int], ring: list[int], page_size: int) -> None:
    """Parks the pages of a finished request's cached tokens (all but its last: the engine's
    invariant) and its `ring` under its id; frees the rest of `pages`."""
    cached = record.num_tokens - 1
    kept = pages_for(cached, page_size)
    if not kept:
      self.free_pages(pages, ring)
      return
    tokens = tuple(record.prompt_ids + record.token_ids)[:cached]
    routes = record.prompt_routing + record.routing
    self.park(record.request_id, Parked(tokens, pages[:kept], routes, ring))
    self.allocator.free(pages[kept:])

  def allocate(self, n: int, shard: int = 0) -> list[int] | None:
    """`n` free pages of `shard` from the allocator, evicting that shard's parked entries (the
    least recently parked first) while too few are free; None (nothing taken) if even that is
    not enough."""
    pages = self.allocator.allocate(n, shard)
    while pages is None and self.evict_oldest(shard):
      pages = self.allocator.allocate(n, shard)
    return pages

  def allocate_ring(self, n: int, shard: int = 0) -> list[int] | None:
    """`allocate` in the window pool."""
    pages = self.ring_allocator.allocate(n, shard)
    while pages is None and self.evict_oldest(shard):
      pages = self.ring_allocator.allocate(n, shard)
    return pages

  def shard_of(self, entry: Parked) -> int:
    """The shard whose pages (and ring) `entry` holds."""
    if entry.pages:
      return self.allocator.shard_of(entry.pages[0])
    return self.ring_allocator.shard_of(entry.ring[0]) if entry.ring else 0

  def free(self, entry: Parked) -> None:
    """Frees an entry's pages of both pools (one taken out, or never parked)."""
    self.free_pages(entry.pages, entry.ring)

  def free_pages(self, pages: list[int], ring: list[int]) -> None:
    """Frees pages of the main pool and a ring of the window pool (the engine's requests',
    the entries')."""
    self.allocator.free(pages)
    if ring:
      self.ring_allocator.free(ring)

  def take(self, request_id: str, tokens: tuple[int, ...]) -> Parked | None:
    """Removes and returns the entry of `request_id` if `tokens` start with its tokens (its
    page references pass to the caller); an entry that does not match is dropped."""
    entry = self._entries.pop(request_id, None)
    if entry is None:
      return None
    if tokens[: len(entry.tokens)] != entry.tokens:
      self.free(entry)
      return None
    return entry

  def evict_oldest(self, shard: int | None = None) -> bool:
    """Frees the least recently parked entry (of `shard`; None: of any); False when there is
    none."""
    found = next((k for k, e in self._entries.items() if shard in (None, self.shard_of(e))), None)
    if found is None:
      return False
    entry = self._entries.pop(found)
    self.free(entry)
    self.num_evicted_pages += len(entry.pages)
    return True

  def drop(self, request_id: str) -> bool:
    """Frees the entry of `request_id` (its trajectory ended); False when there is none."""
    entry = self._entries.pop(request_id, None)
    if entry is not None:
      self.free(entry)
    return entry is not None

  def clear(self) -> None:
    """Frees every entry (new weights, released memory)."""
    while self._entries:
      self.free(self._entries.popitem()[1])
