"""Sampling parameters and the per-step token sampler.

Glossary: b batch rows, v vocab.
"""

from __future__ import annotations

import dataclasses
import math
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
    if not 0 <= self.temperature < float("inf"):
      raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
    bad = [t for t in self.stop_token_ids if not 0 <= t < 2**31]
    if bad:
      raise ValueError(f"stop_token_ids must be token ids (>= 0), got {bad}.")


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

  def top_k_log_norm(kth_b1):
    top_k_logits_bv = jnp.where(logits_bv >= kth_b1, logits_bv, -jnp.inf)
    return jax.nn.logsumexp(top_k_logits_bv, axis=-1, keepdims=True)

  threshold_b1 = _kept_threshold(candidates_bc, top_k_b, top_p_b, top_k_log_norm)
  return jnp.where(logits_bv >= threshold_b1, logits_bv, -jnp.inf)


def _kept_threshold(candidates_bc, top_k_b, top_p_b, top_k_log_norm) -> jax.Array:
  """Each row's smallest logit that its top-k set and top-p nucleus keep (`[b, 1]`; -inf for
  a row with neither), from its largest logits in descending order (`candidates_bc`, at least
  its top k) and `top_k_log_norm(kth_b1)`: the log-sum-exp of the whole row's logits at or
  above its k-th value."""
  c = candidates_bc.shape[-1]
  k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, c), c)
  kth_b1 = jnp.take_along_axis(candidates_bc, (k_b - 1)[:, None], axis=-1)
  in_top_k = candidates_bc >= kth_b1
  # The nucleus normalises over the whole top-k set of the row, not only over the candidates:
  # ties at the k-th value may run past the candidates, and each of them takes mass. A tied
  # run is kept or dropped whole (the threshold below), decided by its first member, which
  # lies among the candidates since k <= c.
  log_norm_b1 = top_k_log_norm(kth_b1)
  probs_bc = jnp.where(in_top_k, jnp.exp(candidates_bc - log_norm_b1), 0.0)
  mass_before = jnp.cumsum(probs_bc, axis=-1) - probs_bc
  # top_p = 1 keeps the whole top-k set, also where the mass before a token rounds to 1.
  keep_bc = in_top_k & ((mass_before < top_p_b[:, None]) | (top_p_b[:, None] >= 1.0))
  # The smallest logit still kept is the threshold for the unsorted row.
  threshold_b1 = jnp.min(jnp.where(keep_bc, candidates_bc, jnp.inf), axis=-1, keepdims=True)
  unfiltered_b1 = ((top_k_b <= 0) & (top_p_b >= 1.0))[:, None]
  return jnp.where(unfiltered_b1, -jnp.inf, threshold_b1)


def first_argmax(x_bv: jax.Array) -> jax.Array:
  """`jnp.argmax(x, -1)` (first index of the maximum, int32) for rows without NaN.

  On a CPU, written as a max and a min over indices, because XLA:CPU lowers argmax's
  two-operand reduce to a scalar loop that also drags the elementwise producers fused into it
  out of SIMD (at 16 x 32768 logits plus Gumbel noise, when the sampler drew that way: 5.4 ms
  against 1.0 ms for this form). Elsewhere argmax itself, one reduction, where the two-pass
  form made XLA's GPU compile write its float32 input out and read it twice (at Qwen3-0.6B's
  151,936-token vocabulary and 64 rows: 39 MB written and 78 MB read a step; `launch/bench.py
  kernels`).
  """
  if platform_of(x_bv) != "cpu":
    return jnp.argmax(x_bv, axis=-1).astype(jnp.int32)
  max_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
  index_v = jnp.arange(x_bv.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x_bv == max_b1, index_v, x_bv.shape[-1] - 1), axis=-1)


SAMPLE_BLOCK = 512  # the most vocabulary entries per block of `draw_from_logits`


def sample_block(vocab: int) -> int:
  """Entries per block of `draw_from_logits` for a vocabulary: the largest power of two from
  SAMPLE_BLOCK down to 64 that divides it (Qwen3's 151,936: 128, 1,187 blocks), else
  SAMPLE_BLOCK with the last block padded. Padding copies the logits: on a TPU v5e (compiled
  without one, 64 rows of Qwen3-0.6B) it added 56 MB of temporaries and a write and read of
  the 39 MB of logits a step; GPUs fused it."""
  block = SAMPLE_BLOCK
  while block >= 64:
    if vocab % block == 0:
      return block
    block //= 2
  return SAMPLE_BLOCK


def _first_above(cumulative_bn: jax.Array, target_b: jax.Array, mass_bn: jax.Array) -> jax.Array:
  """Per row, the first index with mass whose running sum exceeds the target (the inverse
  CDF), or the last index with mass where rounding put the target at or past the total.

  Only indices with mass count: XLA's cumsum does not add in order, so the running sum may
  step down or up by a rounding unit across entries of no mass (a filtered-out token, a
  block of them), and counting entries `<= target` would then land on one of them (a token
  of -inf log-prob, drawn about 3e-7 of the time with top-k at Qwen3's vocabulary)."""
  positions = jnp.arange(mass_bn.shape[-1], dtype=jnp.int32)
  has_mass = mass_bn > 0
  above = has_mass & (cumulative_bn > target_b[:, None])
  index_b = jnp.min(jnp.where(above, positions, mass_bn.shape[-1]), axis=-1)
  last_b = jnp.max(jnp.where(has_mass, positions, 0), axis=-1)
  return jnp.minimum(index_b, last_b)


def draw_from_logits(
  uniforms_b2: jax.Array, logits_bv: jax.Array, max_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """One token per row from softmax(logits) by the inverse CDF, in two levels, and each row's
  log-sum-exp. Returns (tokens_b, logsumexp_b).

  The vocabulary is cut into blocks (`sample_block`): one pass over the logits sums each
  block's exp(logit - max) (the same sums give the log-sum-exp); uniform 0 picks a block with
  probability proportional to its sum, uniform 1 a token of that block in proportion to its
  exp. P(token) = (block sum / total) (exp / block sum): the softmax, exactly, up to float32
  rounding of the sums. A token of -inf logit (filtered out) has no mass and is never drawn.

  Why not Gumbel-max (`jax.random.categorical`): its noise is one random number per logit,
  made by threefry, and at Qwen3's 151,936-token vocabulary that work, not the memory read,
  set the sampler's time on an H100 (67 us a step at 64 rows, 4% of the decode step;
  docs/BENCHMARKS.md). Here a row takes two random numbers and the logits are read twice (the
  max, then the block sums), plus one block read again.
  """
  b, v = logits_bv.shape
  z = sample_block(v)
  blocks = -(-v // z)
  padded_bv = logits_bv
  if blocks * z != v:
    padded_bv = jnp.pad(logits_bv, ((0, 0), (0, blocks * z - v)), constant_values=-jnp.inf)
  exp_bnz = jnp.exp(padded_bv.reshape(b, blocks, z) - max_b[:, None, None])
  block_mass_bn = jnp.sum(exp_bnz, axis=-1)
  cumulative_bn = jnp.cumsum(block_mass_bn, axis=-1)
  total_b = cumulative_bn[:, -1]
  block_b = _first_above(cumulative_bn, uniforms_b2[:, 0] * total_b, block_mass_bn)
  # The chosen block's logits, read again (a gather of z per row).
  offsets_z = jnp.arange(z, dtype=jnp.int32)
  inside_bz = jnp.take_along_axis(padded_bv, block_b[:, None] * z + offsets_z, axis=-1)
  mass_bz = jnp.exp(inside_bz - max_b[:, None])
  running_bz = jnp.cumsum(mass_bz, axis=-1)
  token_in_block_b = _first_above(running_bz, uniforms_b2[:, 1] * running_bz[:, -1], mass_bz)
  return block_b * z + token_in_block_b, max_b + jnp.log(total_b)


@dataclasses.dataclass(frozen=True)
class VocabSplit:
  """Where a tensor-parallel engine's logits live: `mesh`, the axes their rows split over and
  those their vocabulary splits over (`logits_spec` of the `batch` and `vocab` rules). Static:
  hashable."""

  mesh: jax.sharding.Mesh
  rows: tuple[str, ...]
  vocab: tuple[str, ...]


def sample_tokens(
  keys_b: jax.Array,
  logits_bv: jax.Array,
  temperature_b: jax.Array,
  top_k_b: jax.Array,
  top_p_b: jax.Array,
  *,
  filter_width: int = SORT_ALL,
  vocab_split: VocabSplit | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row with that row's key; returns (tokens_b, logprobs_b).

  The log-probability is that of the distribution actually sampled from (temperature-scaled,
  then top-k/top-p filtered and renormalised): the chosen logit minus a log-sum-exp, no
  `[b, v]` log-softmax. Greedy rows (temperature 0) take the argmax (the max's pass, which
  every row needs) and report the log-probability under temperature 1, which is what a
  learner would score them with. Sampled rows draw by the inverse CDF (`draw_from_logits`),
  two uniforms per row from its key.

  `filter_width` is static (the engine knows its requests' parameters on the host:
  `filter_width`): NO_FILTER skips filtering, TOP_K_CANDIDATES filters among `lax.top_k`'s
  candidates, SORT_ALL sorts the vocabulary; no device-side branch whose predicate a GPU would
  copy back to the host at every step.

  `vocab_split`: logits split over their vocabulary (a tensor-parallel engine's). Each device
  then filters and draws over its own part (`_draw_on_vocab_shards`: the same distribution; the
  blocks are each device's, so the draws differ from the whole vocabulary's where its part is
  not a whole number of blocks), where XLA gathered every row's logits onto every device
  (`[b, v]` float32 a step: 38.9 MB at Qwen3-8B's vocabulary and 64 rows). SORT_ALL still
  gathers and sorts the whole row for the filter's threshold, and draws on the parts too: a
  row's tokens do not depend on which filter its call runs for the rows beside it.
  """
  if vocab_split is not None:
    split = _vocab_shards(vocab_split, logits_bv.shape)
    if split is not None:
      uniforms_b2 = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys_b)
      return _draw_on_vocab_shards(
        split, filter_width, uniforms_b2, logits_bv, temperature_b, top_k_b, top_p_b
      )
  logits_bv = logits_bv.astype(jnp.float32)
  greedy_b = temperature_b <= 0
  scaled_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
  filtering = filter_width != NO_FILTER
  filtered_bv = (
    filter_logits(scaled_bv, top_k_b, top_p_b, width=filter_width) if filtering else scaled_bv
  )
  # The filter keeps every row's largest logit: the argmax and max of the filtered row are
  # those of the scaled one, and a greedy row's token is its logits' argmax.
  argmax_b = first_argmax(scaled_bv)
  max_b = jnp.take_along_axis(scaled_bv, argmax_b[:, None], axis=-1)[:, 0]
  uniforms_b2 = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys_b)
  drawn_b, filtered_lse_b = draw_from_logits(uniforms_b2, filtered_bv, max_b)
  tokens_b = jnp.where(greedy_b, argmax_b, drawn_b)
  if filtering:  # greedy rows are scored unfiltered, sampled rows by what they drew from
    scored_bv = jnp.where(greedy_b[:, None], scaled_bv, filtered_bv)
    lse_b = jax.nn.logsumexp(scored_bv, axis=-1)
  else:
    scored_bv, lse_b = scaled_bv, filtered_lse_b
  chosen_b = jnp.take_along_axis(scored_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b, chosen_b - lse_b


def _vocab_shards(split: VocabSplit, shape: tuple[int, int]) -> VocabSplit | None:
  """`split` with the axes of more than one device that divide the rows and the vocabulary
  (the rows' dropped where they do not divide), or None where the vocabulary does not split."""
  sizes = dict(split.mesh.shape)
  vocab = tuple(a for a in split.vocab if sizes.get(a, 1) > 1)
  rows = tuple(a for a in split.rows if sizes.get(a, 1) > 1)
  if not vocab or shape[1] % math.prod(sizes[a] for a in vocab):
    return None
  if shape[0] % math.prod(sizes[a] for a in rows):
    rows = ()
  return VocabSplit(split.mesh, rows, vocab)


def _draw_on_vocab_shards(
  split: VocabSplit, width: int, uniforms_b2, logits_bv, temperature_b, top_k_b, top_p_b
):
  """`sample_tokens` with each device on its part of the vocabulary: the max and argmax, the
  filter's threshold (`_threshold_on_vocab_shards`) and each block's mass from its own logits;
  across devices only each row's maxes and argmaxes (`[b, devices]`), block masses
  (`[b, blocks]`), the drawn block (`[b, z]`) and, filtering, each device's `width` largest
  logits (SORT_ALL: its whole part) and a few sums a row."""
  rows = split.rows or None
  vocab = split.vocab
  z = sample_block(logits_bv.shape[1])  # the whole vocabulary's block size
  spec = lambda *dims: jax.sharding.PartitionSpec(*dims)  # noqa: E731

  def draw(uniforms_b2, logits_bv, temperature_b, top_k_b, top_p_b):
    logits_bv = logits_bv.astype(jnp.float32)
    greedy_b = temperature_b <= 0
    scaled_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
    b, part = scaled_bv.shape
    shard = jax.lax.axis_index(vocab)
    local_argmax_b = first_argmax(scaled_bv)
    local_max_b = jnp.take_along_axis(scaled_bv, local_argmax_b[:, None], axis=-1)[:, 0]
    maxes_bd = jax.lax.all_gather(local_max_b, vocab, axis=1)
    argmaxes_bd = jax.lax.all_gather(local_argmax_b + shard * part, vocab, axis=1)
    max_b = jnp.max(maxes_bd, axis=-1)
    first_b = jnp.argmax(maxes_bd == max_b[:, None], axis=-1)  # the lowest ids win ties
    argmax_b = jnp.take_along_axis(argmaxes_bd, first_b[:, None], axis=-1)[:, 0]
    # A filter keeps every row's largest logit, so max_b is the filtered row's max too.
    filtered_bv = scaled_bv
    if width != NO_FILTER:
      threshold_b1 = _threshold_on_vocab_shards(scaled_bv, max_b, top_k_b, top_p_b, width, vocab)
      filtered_bv = jnp.where(scaled_bv >= threshold_b1, scaled_bv, -jnp.inf)
    blocks = -(-part // z)
    padded_bv = jnp.pad(filtered_bv, ((0, 0), (0, blocks * z - part)), constant_values=-jnp.inf)
    exp_bnz = jnp.exp(padded_bv.reshape(b, blocks, z) - max_b[:, None, None])
    mass_bn = jax.lax.all_gather(jnp.sum(exp_bnz, axis=-1), vocab, axis=1, tiled=True)
    cumulative_bn = jnp.cumsum(mass_bn, axis=-1)
    total_b = cumulative_bn[:, -1]
    block_b = _first_above(cumulative_bn, uniforms_b2[:, 0] * total_b, mass_bn)
    owner_b, local_block_b = block_b // blocks, block_b % blocks
    offsets_z = jnp.arange(z, dtype=jnp.int32)
    inside_bz = jnp.take_along_axis(padded_bv, local_block_b[:, None] * z + offsets_z, axis=-1)
    inside_bz = jax.lax.psum(jnp.where((owner_b == shard)[:, None], inside_bz, 0.0), vocab)
    mass_bz = jnp.exp(inside_bz - max_b[:, None])
    running_bz = jnp.cumsum(mass_bz, axis=-1)
    in_block_b = _first_above(running_bz, uniforms_b2[:, 1] * running_bz[:, -1], mass_bz)
    drawn_b = owner_b * part + local_block_b * z + in_block_b
    tokens_b = jnp.where(greedy_b, argmax_b, drawn_b)
    drawn_logit_b = jnp.take_along_axis(inside_bz, in_block_b[:, None], axis=-1)[:, 0]
    chosen_b = jnp.where(greedy_b, max_b, drawn_logit_b)
    # Sampled rows are scored by what they drew from; greedy rows unfiltered.
    lse_b = max_b + jnp.log(total_b)
    if width != NO_FILTER:
      whole_b = jax.lax.psum(jnp.sum(jnp.exp(scaled_bv - max_b[:, None]), axis=-1), vocab)
      lse_b = jnp.where(greedy_b, max_b + jnp.log(whole_b), lse_b)
    return tokens_b.astype(jnp.int32), chosen_b - lse_b

  mapped = jax.shard_map(
    draw,
    mesh=split.mesh,
    in_specs=(spec(rows), spec(rows, vocab), spec(rows), spec(rows), spec(rows)),
    out_specs=(spec(rows), spec(rows)),
    check_vma=False,  # each output is the same on every device of `vocab`, as computed
  )
  return mapped(uniforms_b2, logits_bv, temperature_b, top_k_b, top_p_b)


def _threshold_on_vocab_shards(scaled_bv, max_b, top_k_b, top_p_b, width: int, vocab):
  """`filter_logits`'s threshold (`_kept_threshold`) for logits split over the mesh axes
  `vocab` (inside a `shard_map`): the row's `width` largest logits are among the `width`
  largest of each device's part, so each device gathers only those (`[b, devices * width]`),
  and the top-k set's normaliser is a sum over the devices. SORT_ALL (a nucleus that may run
  past any fixed number of candidates) gathers each device's whole part and sorts the row."""
  if width == SORT_ALL:
    gathered_bv = jax.lax.all_gather(scaled_bv, vocab, axis=1, tiled=True)
    candidates_bc = jnp.sort(gathered_bv, axis=-1)[:, ::-1]
  else:
    local_bc = jax.lax.top_k(scaled_bv, min(width, scaled_bv.shape[1]))[0]
    gathered_bc = jax.lax.all_gather(local_bc, vocab, axis=1, tiled=True)
    candidates_bc = jax.lax.top_k(gathered_bc, min(width, gathered_bc.shape[1]))[0]

  def top_k_log_norm(kth_b1):
    exp_bv = jnp.where(scaled_bv >= kth_b1, jnp.exp(scaled_bv - max_b[:, None]), 0.0)
    return (max_b + jnp.log(jax.lax.psum(jnp.sum(exp_bv, axis=-1), vocab)))[:, None]

  return _kept_threshold(candidates_bc, top_k_b, top_p_b, top_k_log_norm)
