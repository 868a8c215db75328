"""Request state as a plain, serialisable record, and the page allocator.

A `RequestRecord` is everything needed to continue a response on any engine: the prompt, the
tokens generated so far with their log-probs and policy versions, and the sampling state
(parameters and seed). Token i of a request is always sampled with a key derived from
(seed, i), so a request continued elsewhere draws exactly the tokens it would have drawn.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
  """A free list over `num_pages` KV pages."""

  def __init__(self, num_pages: int):
    if num_pages < 1:
      raise ValueError(f"The page budget must be at least 1 page, got {num_pages}.")
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))

  @property
  def num_free(self) -> int:
    return len(self._free)

  def allocate(self, n: int) -> list[int] | None:
    """`n` pages, or None (and nothing taken) if fewer are free."""
    if n > len(self._free):
      return None
    pages = [self._free.pop() for _ in range(n)]
    return pages

  def free(self, pages: list[int]) -> None:
    self._free.extend(reversed(pages))


def pages_for(num_tokens: int, page_size: int) -> int:
  return -(-num_tokens // page_size)
