"""Generation engines for rollout: sampling, KV-cached decoding, per-token logprobs and versions."""

from jaxrl.rollout.engine import ENGINES, Completion, RolloutEngine, StaticEngine
from jaxrl.rollout.sampling import SamplingParams, filter_logits, sample_tokens

__all__ = [
  "ENGINES",
  "Completion",
  "RolloutEngine",
  "SamplingParams",
  "StaticEngine",
  "filter_logits",
  "sample_tokens",
]
