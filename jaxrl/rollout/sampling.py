"""Sampling parameters and the per-step token sampler.

Glossary: b batch rows, v vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from jaxrl.kernels.common import platform_of


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is sampled.

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    top_k: sample among the k most likely tokens; 0 disables it.
    max_new_tokens: the response stops after this many tokens.
    stop_token_ids: tokens that end the response (kept in the output); the engine adds EOS.
    ignore_eos: do not stop at EOS (forced lengths, for benchmarks).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 16
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")


NO_FILTER = 0  # no row uses top-k or top-p
SORT_ALL = -1  # some row needs the whole vocabulary in order (top-p without a small top-k)
TOP_K_CANDIDATES = 64  # every filtering row keeps at most this many: `lax.top_k` suffices


def filter_width(params: Iterable[SamplingParams]) -> int:
  """The sampler's static filter for these requests: NO_FILTER; TOP_K_CANDIDATES when every
  filtering row has 0 < top_k <= TOP_K_CANDIDATES (its nucleus lies inside its top k); else
  SORT_ALL."""
  width = NO_FILTER
  for p in params:
    if 0 < p.top_k <= TOP_K_CANDIDATES:
      width = TOP_K_CANDIDATES
    elif p.top_k > 0 or p.top_p < 1.0:
      return SORT_ALL
  return width


def filter_logits(
  logits_bv: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array, *, width: int = SORT_ALL
) -> jax.Array:
  """Masks logits outside each row's top-k set and top-p nucleus to -inf.

  Ties at the k-th value are kept. The nucleus keeps the most likely tokens whose probability
  mass before them is below top_p, so the most likely token always survives; a row with
  neither keeps every logit. The candidates are the `width` largest logits (`lax.top_k`) when
  every filtering row's top_k is at most `width`, else the whole sorted row (SORT_ALL).
  """
  vocab = logits_bv.shape[-1]
  if 0 < width < vocab:
    candidates_bc = jax.lax.top_k(logits_bv, width)[0]  # descending
  else:
    candidates_bc = jnp.sort(logits_bv, axis=-1)[:, ::-1]
  c = candidates_bc.shape[-1]
  k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, c), c)
  kth_b1 = jnp.take_along_axis(candidates_bc, (k_b - 1)[:, None], axis=-1)
  in_top_k = candidates_bc >= kth_b1
  # The nucleus normalises over the whole top-k set of the row, not only over the candidates:
  # ties at the k-th value may run past the `width` candidates, and each of them takes mass.
  # A tied run is kept or dropped whole (the threshold below), decided by its first member,
  # which lies among the candidates since k <= width.
  top_k_logits_bv = jnp.where(logits_bv >= kth_b1, logits_bv, -jnp.inf)
  log_norm_b1 = jax.nn.logsumexp(top_k_logits_bv, axis=-1, keepdims=True)
  probs_bc = jnp.where(in_top_k, jnp.exp(candidates_bc - log_norm_b1), 0.0)
  mass_before = jnp.cumsum(probs_bc, axis=-1) - probs_bc
  keep_bc = in_top_k & (mass_before < top_p_b[:, None])
  # The smallest logit still kept is the threshold for the unsorted row.
  threshold_b1 = jnp.min(jnp.where(keep_bc, candidates_bc, jnp.inf), axis=-1, keepdims=True)
  unfiltered_b1 = ((top_k_b <= 0) & (top_p_b >= 1.0))[:, None]
  threshold_b1 = jnp.where(unfiltered_b1, -jnp.inf, threshold_b1)
  return jnp.where(logits_bv >= threshold_b1, logits_bv, -jnp.inf)


def first_argmax(x_bv: jax.Array) -> jax.Array:
  """`jnp.argmax(x, -1)` (first index of the maximum, int32) for rows without NaN.

  On a CPU, written as a max and a min over indices, because XLA:CPU lowers argmax's
  two-operand reduce to a scalar loop that also drags the elementwise producers fused into it
  out of SIMD: at 16 x 32768 logits plus Gumbel noise it took 5.4 ms against 1.0 ms for this
  form. Elsewhere argmax itself: one reduction that the noise is fused into, where the two-pass
  form makes XLA's GPU compile write the noisy float32 logits out and read them twice (at
  Qwen3-0.6B's 151,936-token vocabulary and 64 rows: 39 MB written and 78 MB read a step, and
  three more kernels; `launch/bench.py kernels`).
  """
  if platform_of(x_bv) != "cpu":
    return jnp.argmax(x_bv, axis=-1).astype(jnp.int32)
  max_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
  index_v = jnp.arange(x_bv.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x_bv == max_b1, index_v, x_bv.shape[-1] - 1), axis=-1)


def sample_tokens(
  keys_b: jax.Array,
  logits_bv: jax.Array,
  temperature_b: jax.Array,
  top_k_b: jax.Array,
  top_p_b: jax.Array,
  *,
  filter_width: int = SORT_ALL,
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row with that row's key; returns (tokens_b, logprobs_b).

  The log-probability is that of the distribution actually sampled from (temperature-scaled,
  then top-k/top-p filtered and renormalised): the chosen logit minus a log-sum-exp, no
  `[b, v]` log-softmax. Greedy rows (temperature 0) take the argmax in the same pass (no noise
  added to them) and report the log-probability under temperature 1, which is what a learner
  would score them with.

  `filter_width` is static (the engine knows its requests' parameters on the host:
  `filter_width`): NO_FILTER skips filtering, TOP_K_CANDIDATES filters among `lax.top_k`'s
  candidates, SORT_ALL sorts the vocabulary; no device-side branch whose predicate a GPU would
  copy back to the host at every step.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  greedy_b = temperature_b <= 0
  scaled_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
  filtering = filter_width != NO_FILTER
  filtered_bv = (
    filter_logits(scaled_bv, top_k_b, top_p_b, width=filter_width) if filtering else scaled_bv
  )
  # Gumbel-max, as jax.random.categorical does it, but with first_argmax (see there). The
  # filter keeps every row's largest logit, so a greedy row's argmax is its logits' argmax.
  gumbel_bv = jax.vmap(lambda key: jax.random.gumbel(key, filtered_bv.shape[-1:]))(keys_b)
  tokens_b = first_argmax(filtered_bv + jnp.where(greedy_b[:, None], 0.0, gumbel_bv))
  scored_bv = jnp.where(greedy_b[:, None], scaled_bv, filtered_bv) if filtering else scaled_bv
  chosen_b = jnp.take_along_axis(scored_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b, chosen_b - jax.nn.logsumexp(scored_bv, axis=-1)
