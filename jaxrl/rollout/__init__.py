"""Generation engines for rollout: continuous batching over paged KV, the static baseline,
sampling, per-token log-probs and policy versions, serialisable request state."""

from jaxrl.rollout.engine import Completion, RolloutEngine, StaticEngine
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.rollout.requests import PageAllocator, RequestRecord
from jaxrl.rollout.sampling import SamplingParams, filter_logits, sample_tokens

__all__ = [
  "Completion",
  "PageAllocator",
  "PagedConfig",
  "PagedEngine",
  "RequestRecord",
  "RolloutEngine",
  "SamplingParams",
  "StaticEngine",
  "filter_logits",
  "sample_tokens",
]
