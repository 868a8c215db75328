"""Turning completions and rewards into the learner's padded batch.

Glossary: b sequences, t target positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl.rollout.engine import Completion
from jaxrl.train.batch import TrainBatch
from jaxrl.train.learner import Learner
from jaxrl.train.routing import routes_from_completions

LENGTH_MULTIPLE = 8  # short batch lengths round up to this, so that jit shapes repeat
FINE_UNTIL = 128  # above it, lengths round up to one of 4 buckets per doubling
BUCKETS_PER_OCTAVE = 4


def batch_length(longest: int) -> int:
  """The padded length of a batch whose longest prompt + response has `longest` tokens.

  Multiples of 8 up to 128; above, 4 buckets per doubling (160, 192, 224, 256, 320, ...,
  3072, 3584, 4096, 5120, ...), so a run whose batches reach thousands of tokens meets a few
  dozen shapes at most, at most 25% of them padding, instead of a new one nearly every step.
  """
  if longest <= FINE_UNTIL:
    return max(LENGTH_MULTIPLE, -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)
  step = (1 << ((longest - 1).bit_length() - 1)) // BUCKETS_PER_OCTAVE
  return -(-longest // step) * step


def batch_lengths(shortest_prompt: int, longest_prompt: int, max_new_tokens: int) -> list[int]:
  """Every padded length a batch of these prompts and responses of 1..`max_new_tokens`
  tokens can have (what `Learner.precompile` compiles for)."""
  first = batch_length(shortest_prompt + 1)
  last = batch_length(longest_prompt + max_new_tokens)
  lengths, n = [], first
  while n <= last:
    lengths.append(n)
    n = batch_length(n + 1)
  return lengths


def pad_sequences(
  prompts: Sequence[Sequence[int]],
  responses: Sequence[Sequence[int]],
  pad_id: int,
  length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads prompt + response rows; returns (tokens [b, t + 1], response-target mask [b, t]).

  `length` fixes t + 1 (by default `batch_length` of the longest row, so jit shapes repeat).
  """
  longest = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
  if length is None:
    length = batch_length(longest)
  if longest > length:
    raise ValueError(f"A sequence of {longest} tokens does not fit the batch length {length}.")
  tokens_bt = np.full((len(prompts), length), pad_id, np.int32)
  mask_bt = np.zeros((len(prompts), length - 1), np.float32)
  for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
    tokens_bt[i, : len(p) + len(r)] = [*p, *r]
    mask_bt[i, len(p) - 1 : len(p) + len(r) - 1] = 1.0
  return tokens_bt, mask_bt


def build_batch(
  completions: Sequence[Completion],
  advantages_b: np.ndarray,
  pad_id: int,
  length: int | None = None,
) -> TrainBatch:
  """The learner's batch for these completions, with rollout log-probs as behaviour log-probs
  and (MoE, paged engine) the routes rollout took, for routing replay."""
  tokens_bt, mask_bt = pad_sequences(
    [c.prompt_ids for c in completions], [c.token_ids for c in completions], pad_id, length
  )
  old_logp_bt = np.zeros(mask_bt.shape, np.float32)
  for i, c in enumerate(completions):
    start = len(c.prompt_ids) - 1
    old_logp_bt[i, start : start + len(c.token_ids)] = c.logprobs
  return TrainBatch(
    tokens_bt=tokens_bt,
    mask_bt=mask_bt,
    old_logp_bt=old_logp_bt,
    advantages_b=np.asarray(advantages_b, np.float32),
    routes_btlk=routes_from_completions(completions, mask_bt.shape[1]),
  )


def logprob_mismatch(
  learner: Learner, completions: Sequence[Completion], pad_id: int
) -> dict[str, float]:
  """How far the rollout's log-probs are from the learner's for the same tokens.

  Meaningful when the learner holds the weights that generated `completions`: then any
  difference is train/inference mismatch (numerics, sharding, or a sampler bug).
  """
  batch = build_batch(completions, np.zeros(len(completions)), pad_id)
  learner_logp_bt = np.asarray(learner.logprobs(learner.params, batch.tokens_bt))
  mask_bt = batch.mask_bt > 0
  diff = np.abs(learner_logp_bt - batch.old_logp_bt)[mask_bt]
  return {
    "tokens": int(mask_bt.sum()),
    "max_abs_diff": float(diff.max()),
    "mean_abs_diff": float(diff.mean()),
  }
