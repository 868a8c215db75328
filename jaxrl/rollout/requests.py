"""Request state as a plain, serialisable record, and the page allocator.

A `RequestRecord` is everything needed to continue a response on any engine: the prompt, the
tokens generated so far with their log-probs and policy versions, and the sampling state
(parameters and seed). Token i of a request is always sampled with a key derived from
(seed, i), so a request continued elsewhere draws exactly the tokens it would have drawn.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jaxrl.rollout.engine import Completion, bucket
from jaxrl.rollout.sampling import SamplingParams


@dataclasses.dataclass
class RequestRecord:
  """A request and what it has produced so far.

  Attributes:
    request_id: unique within an engine.
    prompt_ids: the prompt's token ids.
    sampling: how its tokens are sampled.
    seed: sampling seed; token i uses a key derived from (seed, i).
    token_ids: generated ids so far.
    logprobs: log-probability of each generated id under the distribution it was drawn from.
    versions: policy version of the weights that produced each generated id.
    routing: MoE models only: per generated id, the expert ids each layer chose (`[layer][k]`)
      in the forward pass that produced it, i.e. for its input token (the previous token, or
      the last prompt token for the first id).
    prompt_routing: MoE models only: the same for prompt tokens 0..len(prompt)-2, routed in
      prefill. `prompt_routing + routing` covers exactly the inputs a learner feeds to score
      the response (prompt + response without its last token), ready for routing replay.
    finish_reason: None while unfinished, else "stop" or "length".
    keep_kv: when it finishes, the engine keeps its KV pages for a later request with the same
      id whose tokens start with its tokens (the next turn of a multi-turn trajectory, after
      its environment answered), while memory allows (`PagedConfig.keep_turn_kv`).
  """

  request_id: str
  prompt_ids: list[int]
  sampling: SamplingParams
  seed: int = 0
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  routing: list[list[list[int]]] = dataclasses.field(default_factory=list)
  prompt_routing: list[list[list[int]]] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  keep_kv: bool = False  # defaulted: records checkpointed before this field load as before

  @property
  def num_tokens(self) -> int:
    """Prompt plus generated tokens."""
    return len(self.prompt_ids) + len(self.token_ids)

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dict (lists of ints and floats, nested sampling params)."""
    out = dataclasses.asdict(self)
    out["sampling"]["stop_token_ids"] = list(self.sampling.stop_token_ids)
    return out

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
    sampling = dict(data["sampling"])
    sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids", ()))
    return cls(**{**data, "sampling": SamplingParams(**sampling)})


class PageAllocator:
  """A free list over `num_pages` KV pages in each of `shards` shards, with reference counts: a
  page shared by several requests (a common prompt prefix) returns to the free list when the
  last one frees it. Shard i holds pages `i * num_pages` to `(i + 1) * num_pages - 1` (ids are
  global): an engine whose pool splits over its rows' devices (`PagedCalls.page_shards`) gives
  a request the pages of its row's shard only."""

  def __init__(self, num_pages: int, shards: int = 1):
    if num_pages < 1:
      raise ValueError(f"The page budget must be at least 1 page, got {num_pages}.")
    self.pages_per_shard = num_pages
    self.shards = shards
    self.num_pages = num_pages * shards  # every shard's
    self._free = [
      list(range((i + 1) * num_pages - 1, i * num_pages - 1, -1)) for i in range(shards)
    ]
    self._refs = [0] * self.num_pages

  @property
  def num_free(self) -> int:
    return sum(len(free) for free in self._free)

  def free_in(self, shard: int) -> int:
    return len(self._free[shard])

  def shard_of(self, page: int) -> int:
    return page // self.pages_per_shard

  def allocate(self, n: int, shard: int = 0) -> list[int] | None:
    """`n` pages of `shard`, or None (and nothing taken) if fewer are free there."""
    free = self._free[shard]
    if n > len(free):
      return None
    pages = [free.pop() for _ in range(n)]
    for page in pages:
      self._refs[page] = 1
    return pages

  def share(self, pages: list[int]) -> list[int]:
    """Another holder of these (allocated) pages; returns them."""
    for page in pages:
      if self._refs[page] < 1:
        raise ValueError(f"Page {page} is free: only allocated pages can be shared.")
      self._refs[page] += 1
    return list(pages)

  def free(self, pages: list[int]) -> None:
    """Drops one holder of each page; pages nobody holds any more are free again. A page
    freed more often than it is held (a bookkeeping error that would hand one page to two
    requests, each then overwriting the other's keys) raises, and nothing is freed."""
    held = collections.Counter(pages)
    for page, count in held.items():
      if not 0 <= page < self.num_pages or self._refs[page] < count:
        holders = self._refs[page] if 0 <= page < self.num_pages else "no"
        raise ValueError(
          f"Page {page} freed {count} time(s) but held by {holders} request(s) "
          f"(pages 0..{self.num_pages - 1}): it is free already, or was never allocated."
        )
    for page in reversed(pages):
      self._refs[page] -= 1
      if self._refs[page] == 0:
        self._free[self.shard_of(page)].append(page)


def pages_for(num_tokens: int, page_size: int) -> int:
  return -(-num_tokens // page_size)


def longest_cached(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> int:
  """The most tokens a request's pages may hold: its prompt and every new token but the last
  (the last sampled token is never attended to), within the model's `max_seq_len`."""
  return min(prompt_len + max_new_tokens, max_seq_len) - 1


def check_request(record: RequestRecord, max_seq_len: int, page_size: int, num_pages: int) -> None:
  """Raises, saying what to change, if the request could never run: an empty prompt, no room
  for a new token (the model's `max_seq_len`, or `max_new_tokens` already generated), a seed
  outside uint32, or a longest sequence over the page budget."""
  rid, n = record.request_id, record.num_tokens
  if not record.prompt_ids:
    raise ValueError(f"Request {rid} has an empty prompt; give it at least one token.")
  if n >= max_seq_len:
    what = "prompt" if not record.token_ids else "prompt and response so far"
    raise ValueError(
      f"Request {rid}: {what} of {n} tokens leaves no room for a new token under the "
      f"model's max_seq_len={max_seq_len}; shorten it to at most {max_seq_len - 1} tokens."
    )
  if len(record.token_ids) >= record.sampling.max_new_tokens:
    raise ValueError(
      f"Request {rid} already holds {len(record.token_ids)} generated tokens, its "
      f"max_new_tokens={record.sampling.max_new_tokens}; raise max_new_tokens to continue it."
    )
  if not 0 <= record.seed < 2**32:
    raise ValueError(f"Request {rid}: seed must be in [0, 2**32), got {record.seed}.")
  cached = longest_cached(len(record.prompt_ids), record.sampling.max_new_tokens, max_seq_len)
  pages = pages_for(cached, page_size)
  if pages > num_pages:
    fix = (
      "raise rollout.paged.num_pages or shorten the prompt"
      if pages_for(len(record.prompt_ids), page_size) > num_pages
      else "raise rollout.paged.num_pages or lower max_new_tokens to at most "
      f"{num_pages * page_size - len(record.prompt_ids) + 1}"
    )
    raise ValueError(
      f"Request {rid} may cache {cached} tokens = {pages} pages of {page_size}, more "
      f"than the page budget of {num_pages}; {fix}."
    )


def bucketed_page_pairs(pairs: list[tuple[int, int]], num_pages: int) -> tuple[np.ndarray, ...]:
  """(sources, targets) of page copies, padded to a power of two with targets out of range."""
  count = bucket(len(pairs), 1)
  source = np.zeros((count,), np.int32)
  target = np.full((count,), num_pages, np.int32)
  for i, (a, b) in enumerate(pairs):
    source[i], target[i] = a, b
  return source, target


def record_prompt_routing(records, start: int, routing_btlk: np.ndarray) -> None:
  """MoE: appends to each record the routes of its prompt tokens that a prefill chunk from
  `start` routed (`routing_btlk`, one row per record). Only tokens not yet traced: a re-prefill
  after preemption re-routes tokens whose routes were recorded when first processed; those
  are kept."""
  for i, r in enumerate(records):
    first, stop = len(r.prompt_routing), len(r.prompt_ids) - 1
    for position in range(max(first, start), min(stop, start + routing_btlk.shape[1])):
      r.prompt_routing.append(routing_btlk[i, position - start].tolist())


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
