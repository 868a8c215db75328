"""Token log-probabilities, the PPO clipped policy loss and the k3 KL penalty.

Shape suffixes: b = sequences in the (micro-)batch, t = tokens, v = vocabulary.

Every loss and metric here is a SUM over the micro-batch divided by a count over the WHOLE batch
(`num_tokens`, `num_seqs`), so summing a quantity over the micro-batches of a batch (gradient
accumulation, or data-parallel shards followed by a psum) gives exactly that quantity for the
whole batch. A sequence is a row of the micro-batch, or with segment ids a segment of a packed
row (`jaxrl.train.packing`): the per-sequence sums (GRPO's sequence mean, GSPO's ratio, sequence
behaviour weights) are then taken per segment, and the loss is the same.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.model.transformer import LMHead
from jaxrl.train.vocab_blocks import vocab_block_logprobs, vocab_block_rows

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
RATIO_LEVELS = ("token", "sequence")
PROXIMAL = ("behaviour", "recompute")
BEHAVIOUR_CORRECTIONS = ("none", "truncate", "mask")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Policy-loss settings.

  Attributes:
    clip_low: the ratio is clipped below at `1 - clip_low`.
    clip_high: the ratio is clipped above at `1 + clip_high`; DAPO's clip-higher sets it above
      `clip_low` (e.g. 0.28) to leave room for low-probability tokens to grow.
    aggregation: `"token-mean"`: every masked token of the batch weighs the same (DAPO, Dr.
      GRPO); `"seq-mean-token-mean"`: mean over each sequence's tokens, then mean over sequences
      (the original GRPO).
    kl_weight: weight of the k3 KL penalty to the reference policy; 0 turns it off.
    ratio_level: `"token"`: one importance ratio per token (PPO, GRPO, DAPO); `"sequence"`:
      GSPO's length-normalised sequence ratio `exp(mean_t(logp - old_logp))`, clipped per
      sequence and shared by its tokens (pair it with `seq-mean-token-mean` and small clip
      ranges, e.g. 3e-4 / 4e-4).
    proximal: which log-probs the clipped ratio is taken against. `"behaviour"`: the rollout's
      (the policy that sampled the tokens). `"recompute"`: decoupled PPO: the learner
      recomputes them with its weights at the start of the step (the proximal policy), and the
      gap between proximal and behaviour policy (staleness, or train/inference mismatch) is
      corrected by the behaviour weight below.
    behaviour_correction: with `proximal="recompute"`, how the importance weight
      `w = pi_prox / pi_behaviour` (no gradient) enters the loss: `"none"` (w = 1),
      `"truncate"` (truncated importance sampling: each token's loss times `min(w, cap)`) or
      `"mask"` (tokens, or whole sequences, with `w` outside `[1 / cap, cap]` are dropped).
    behaviour_level: `"token"`: a weight per token; `"sequence"`: one weight per sequence,
      the product of its token weights.
    behaviour_cap: the truncation cap / mask band of the behaviour weight; > 1.
  """

  clip_low: float = 0.2
  clip_high: float = 0.2
  aggregation: str = "token-mean"
  kl_weight: float = 0.0
  ratio_level: str = "token"
  proximal: str = "behaviour"
  behaviour_correction: str = "none"
  behaviour_level: str = "token"
  behaviour_cap: float = 2.0

  def __post_init__(self):
    if not 0.0 <= self.clip_low < 1.0:
      raise ValueError(
        f"LossConfig.clip_low must be in [0, 1) so that 1 - clip_low > 0, got {self.clip_low}."
      )
    if self.clip_high < 0.0:
      raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}.")
    if self.aggregation not in LOSS_AGGREGATIONS:
      raise ValueError(
        f"LossConfig.aggregation must be one of {LOSS_AGGREGATIONS}, got {self.aggregation!r}."
      )
    if self.kl_weight < 0.0:
      raise ValueError(f"LossConfig.kl_weight must be >= 0, got {self.kl_weight}.")
    for name, allowed in (
      ("ratio_level", RATIO_LEVELS),
      ("proximal", PROXIMAL),
      ("behaviour_correction", BEHAVIOUR_CORRECTIONS),
      ("behaviour_level", RATIO_LEVELS),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(
          f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}."
        )
    if self.behaviour_correction != "none" and self.proximal != "recompute":
      raise ValueError(
        f"LossConfig.behaviour_correction={self.behaviour_correction!r} corrects the gap "
        "between proximal and behaviour policy, so it needs proximal='recompute'."
      )
    if not self.behaviour_cap > 1.0:
      raise ValueError(f"LossConfig.behaviour_cap must be > 1, got {self.behaviour_cap}.")


def token_logprobs(
  logits_btv: jax.Array, targets_bt: jax.Array, temperature: float = 1.0
) -> jax.Array:
  """Log-probability of each target token under `softmax(logits / temperature)`.

  Computed in fp32 whatever the dtype of `logits_btv`: a bf16 log-softmax loses the small
  differences between policy and old-policy log-probs that the importance ratio is made of.

  Args:
    logits_btv: `[B, T, V]` logits (any float dtype).
    targets_bt: `[B, T]` integer token ids.
    temperature: the sampling temperature the rollouts used; must be > 0.

  Returns:
    `[B, T]` fp32 log-probabilities.
  """
  if isinstance(temperature, int | float) and temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}.")
  logits_btv = logits_btv.astype(jnp.float32) / temperature
  logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  target_logits_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
  return target_logits_bt - logz_bt


def chunked_token_logprobs(
  hidden_btd: jax.Array,
  head: LMHead,
  targets_bt: jax.Array,
  temperature: float = 1.0,
  *,
  vocab_limit: int = 0,
  chunk: int = 512,
  vocab_shards: int = 1,
  logit_softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """`token_logprobs` of the LM head applied to `hidden_btd`, and each position's entropy (at
  the same temperature), with at most about `[B, chunk, V]` float32 logits at once.

  The `[B, T, V]` fp32 logits of a long sequence over a large vocabulary (4 bytes x 151,936 per
  token for Qwen3) would dwarf everything else the learner holds. The head is applied a block
  of vocabulary rows at a time, every position at once (`jaxrl.train.vocab_blocks`): blocks of
  `chunk * V / T` rows (a multiple of 128) hold what `chunk` positions of the whole vocabulary
  would, and the head is read once forward and twice backward, however long the sequence.

  Args:
    hidden_btd: final hidden states (`Model.apply(..., return_hidden=True)`).
    head: the LM head (`Model.lm_head(params)`), applied in the hidden states' dtype.
    targets_bt: `[B, T]` integer token ids.
    temperature: the sampling temperature the rollouts used; must be > 0.
    vocab_limit: ids at and past it are masked out (`ModelConfig.vocab_limit`); 0 keeps all.
    chunk: positions whose whole-vocabulary logits bound the memory (`train.logprob_chunk`);
      with `vocab_shards`, those of one shard's part of the vocabulary, on each device.
    vocab_shards: devices the head's vocabulary axis is sharded over (tensor parallelism):
      each block takes rows from every shard, so the head is never gathered.
    logit_softcap: the model's `final_logit_softcap` (Gemma 2), applied to the float32
      logits as the model applies it; 0 for none.

  Returns:
    (`[B, T]` fp32 log-probabilities, `[B, T]` fp32 entropies).
  """
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}.")
  vocab = head.weights.shape[0 if head.vocab_major else 1]
  rows = vocab_block_rows(vocab // vocab_shards, targets_bt.shape[1], chunk)
  return vocab_block_logprobs(
    hidden_btd, head, targets_bt, temperature, vocab_limit=vocab_limit, rows=rows,
    shards=vocab_shards, logit_softcap=logit_softcap,
  )  # fmt: skip


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(policy || reference), per token.

  `exp(ref - logp) - (ref - logp) - 1`: non-negative, zero iff `logp == ref_logp`, and unbiased
  for samples drawn from the policy.

  Args:
    logp: log-probabilities of the sampled tokens under the policy.
    ref_logp: the same tokens' log-probabilities under the reference; same shape.

  Returns:
    The per-token estimate, shape of `logp`, fp32.
  """
  log_ratio = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
  return jnp.exp(log_ratio) - log_ratio - 1.0


class _Sequences(NamedTuple):
  """Where the sequences of a micro-batch are: one per row (`keys_bt` None), or segments of
  packed rows, `keys_bt` numbering each (row, segment id) pair, `count` numbers in all."""

  keys_bt: jax.Array | None
  count: int

  @classmethod
  def of(cls, shape: tuple[int, int], segment_ids_bt: jax.Array | None) -> "_Sequences":
    if segment_ids_bt is None:
      return cls(None, shape[0])
    b, t = shape
    # At most t segments per row (each holds >= 1 position): ids 0..t-1, and -1 for padding.
    keys_bt = jnp.arange(b)[:, None] * (t + 1) + segment_ids_bt.astype(jnp.int32) + 1
    return cls(keys_bt, b * (t + 1))

  def sum(self, x_bt: jax.Array) -> jax.Array:
    """Per-sequence sums of `x_bt`, `[sequences, 1]`."""
    if self.keys_bt is None:
      return x_bt.sum(axis=1, keepdims=True)
    if x_bt.dtype == jnp.bool_:
      x_bt = x_bt.astype(jnp.int32)
    return jax.ops.segment_sum(x_bt.ravel(), self.keys_bt.ravel(), self.count)[:, None]

  def spread(self, x_s1: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Each position gets its sequence's value of `x_s1` (`[sequences, 1]`)."""
    if self.keys_bt is None:
      return jnp.broadcast_to(x_s1, shape)
    return x_s1[:, 0][self.keys_bt]


def _aggregate(
  value_bt: jax.Array,
  mask_bt: jax.Array,
  aggregation: str,
  num_tokens: jax.Array | float,
  num_seqs: jax.Array | float,
  seqs: _Sequences,
) -> jax.Array:
  """Sums `value_bt` over masked tokens, normalised by whole-batch counts (see module doc)."""
  value_bt = jnp.where(mask_bt, value_bt, 0.0)
  if aggregation == "token-mean":
    return value_bt.sum() / jnp.maximum(num_tokens, 1.0)
  # seq-mean-token-mean: a sequence with no masked tokens has sum 0 and so contributes 0.
  seq_len_s1 = jnp.maximum(seqs.sum(mask_bt), 1)
  return (seqs.sum(value_bt) / seq_len_s1).sum() / jnp.maximum(num_seqs, 1.0)


def policy_loss(
  logp_bt: jax.Array,
  old_logp_bt: jax.Array,
  advantages_b: jax.Array,
  mask_bt: jax.Array,
  cfg: LossConfig,
  *,
  num_tokens: jax.Array | float,
  num_seqs: jax.Array | float,
  ref_logp_bt: jax.Array | None = None,
  behaviour_logp_bt: jax.Array | None = None,
  segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clipped surrogate loss (plus an optional k3 KL penalty) of one micro-batch.

  Per token, with `ratio = exp(logp - old_logp)` (or GSPO's sequence ratio, see
  `LossConfig.ratio_level`), the sequence's advantage `A` and the behaviour weight `w` (1
  unless `cfg.behaviour_correction` says otherwise):
  `loss_t = -w * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
  + kl_weight * k3(logp, ref_logp)`, aggregated over the masked tokens as `cfg.aggregation` says.

  Normalisation uses whole-batch counts, so that the sum of the returned loss over the
  micro-batches of a batch is the loss of the whole batch (and likewise its gradient):
    - `token-mean`: `sum_masked(loss_t) / num_tokens`.
    - `seq-mean-token-mean`: `sum_seqs(mean_masked_in_seq(loss_t)) / num_seqs`; a sequence with
      no masked tokens contributes 0.

  Args:
    logp_bt: `[B, T]` log-probs of the sampled tokens under the policy being trained.
    old_logp_bt: `[B, T]` log-probs the ratio is taken against (no gradient): the behaviour
      policy's, or with `cfg.proximal="recompute"` the proximal policy's.
    advantages_b: `[B]` one advantage per sequence (no gradient); with `segment_ids_bt`,
      `[B, T]`: each position its sequence's advantage.
    mask_bt: `[B, T]` bool (or 0/1): the tokens that count (completion tokens, not padding or
      prompt). Values at unmasked positions are ignored, even if inf or NaN.
    cfg: clip range, aggregation and KL weight.
    num_tokens: masked tokens in the WHOLE batch, across all micro-batches.
    num_seqs: sequences in the WHOLE batch, across all micro-batches.
    ref_logp_bt: `[B, T]` reference-policy log-probs (no gradient); required if
      `cfg.kl_weight > 0`.
    behaviour_logp_bt: `[B, T]` log-probs of the policy that sampled the tokens (the rollout
      engine's); required if `cfg.behaviour_correction != "none"`.
    segment_ids_bt: packed rows: int `[B, T]`, the sequence of each position within its row
      (0, 1, ...; -1 for padding, which must be off the mask). None: each row is one sequence.

  Returns:
    `(loss, metrics)`. Every metric is, like the loss, a micro-batch sum over a whole-batch count,
    so metrics also add up across micro-batches:
      - `pg_loss`: the clipped-surrogate part of the loss, aggregated as `cfg.aggregation`.
      - `kl_penalty`: `kl_weight` times the k3 KL aggregated as `cfg.aggregation`;
        `loss == pg_loss + kl_penalty`.
      - `kl`: mean k3 KL per masked token (over `num_tokens`); 0 without a reference.
      - `clip_frac`: fraction of masked tokens (over `num_tokens`) where the min picks the
        clipped term and it differs from the unclipped one, i.e. `A > 0` and
        `ratio > 1 + clip_high`, or `A < 0` and `ratio < 1 - clip_low`.
      - `ratio_mean`: mean importance ratio per masked token (over `num_tokens`).
      - `behaviour_weight_mean`, `behaviour_weight_sq_mean`: mean of `w` and of `w^2` per
        masked token (their ratio `mean^2 / sq_mean` is the effective sample size fraction).
      - `behaviour_adjusted_frac`: fraction of masked tokens whose weight was truncated or
        masked.

  Raises:
    ValueError: `cfg.kl_weight > 0` without `ref_logp_bt`, or mismatched shapes.
  """
  if cfg.kl_weight > 0 and ref_logp_bt is None:
    raise ValueError(
      f"LossConfig.kl_weight={cfg.kl_weight} > 0 needs ref_logp_bt (reference-policy log-probs)."
    )
  if cfg.behaviour_correction != "none" and behaviour_logp_bt is None:
    raise ValueError(
      f"LossConfig.behaviour_correction={cfg.behaviour_correction!r} needs behaviour_logp_bt "
      "(the rollout's log-probs)."
    )
  shapes = {"logp_bt": logp_bt.shape, "old_logp_bt": old_logp_bt.shape, "mask_bt": mask_bt.shape}
  if ref_logp_bt is not None:
    shapes["ref_logp_bt"] = ref_logp_bt.shape
  if behaviour_logp_bt is not None:
    shapes["behaviour_logp_bt"] = behaviour_logp_bt.shape
  if len(set(shapes.values())) != 1 or len(logp_bt.shape) != 2:
    raise ValueError(f"Expected equal [B, T] shapes, got {shapes}.")
  if segment_ids_bt is None and advantages_b.shape != logp_bt.shape[:1]:
    raise ValueError(
      f"advantages_b must be [B]={logp_bt.shape[:1]} (one per sequence), got {advantages_b.shape}."
    )
  if segment_ids_bt is not None and (
    advantages_b.shape != logp_bt.shape or segment_ids_bt.shape != logp_bt.shape
  ):
    raise ValueError(
      f"Packed rows: advantages_b and segment_ids_bt must be [B, T]={logp_bt.shape} (one per "
      f"position), got {advantages_b.shape} and {segment_ids_bt.shape}."
    )

  seqs = _Sequences.of(logp_bt.shape, segment_ids_bt)
  mask_bt = jnp.asarray(mask_bt) != 0
  logp_bt = logp_bt.astype(jnp.float32)
  old_logp_bt = jax.lax.stop_gradient(old_logp_bt.astype(jnp.float32))
  adv = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))
  adv_bt = adv if segment_ids_bt is not None else adv[:, None]  # [B, T] or [B, 1]
  inv_tokens = 1.0 / jnp.maximum(num_tokens, 1.0)

  # Zero the log-ratio where masked, before exp, so that padding garbage cannot overflow to inf
  # and turn the masked sum (or its gradient) into NaN.
  log_ratio_bt = jnp.where(mask_bt, logp_bt - old_logp_bt, 0.0)
  if cfg.ratio_level == "sequence":  # GSPO: exp of the mean token log-ratio, per sequence
    seq_len_s1 = jnp.maximum(seqs.sum(mask_bt), 1)
    log_ratio_bt = seqs.spread(seqs.sum(log_ratio_bt) / seq_len_s1, mask_bt.shape)
  ratio_bt = jnp.exp(log_ratio_bt)
  clipped_ratio_bt = jnp.clip(ratio_bt, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  weight_bt, adjusted_bt = behaviour_weights(
    old_logp_bt, behaviour_logp_bt, mask_bt, cfg, segment_ids_bt
  )
  pg_loss_bt = -weight_bt * jnp.minimum(ratio_bt * adv_bt, clipped_ratio_bt * adv_bt)
  is_clipped_bt = ((adv_bt > 0) & (ratio_bt > 1.0 + cfg.clip_high)) | (
    (adv_bt < 0) & (ratio_bt < 1.0 - cfg.clip_low)
  )
  pg_loss = _aggregate(pg_loss_bt, mask_bt, cfg.aggregation, num_tokens, num_seqs, seqs)

  if ref_logp_bt is None:
    kl_tok = jnp.zeros((), jnp.float32)
    kl_penalty = jnp.zeros((), jnp.float32)
  else:
    ref_logp_bt = jax.lax.stop_gradient(ref_logp_bt.astype(jnp.float32))
    kl_bt = kl_k3(jnp.where(mask_bt, logp_bt, 0.0), jnp.where(mask_bt, ref_logp_bt, 0.0))
    kl_tok = jnp.where(mask_bt, kl_bt, 0.0).sum() * inv_tokens
    kl_penalty = cfg.kl_weight * _aggregate(
      kl_bt, mask_bt, cfg.aggregation, num_tokens, num_seqs, seqs
    )

  metrics = {
    "pg_loss": pg_loss,
    "kl_penalty": kl_penalty,
    "kl": kl_tok,
    "clip_frac": (is_clipped_bt & mask_bt).sum() * inv_tokens,
    "ratio_mean": jnp.where(mask_bt, ratio_bt, 0.0).sum() * inv_tokens,
    "behaviour_weight_mean": jnp.where(mask_bt, weight_bt, 0.0).sum() * inv_tokens,
    "behaviour_weight_sq_mean": jnp.where(mask_bt, weight_bt**2, 0.0).sum() * inv_tokens,
    "behaviour_adjusted_frac": (adjusted_bt & mask_bt).sum() * inv_tokens,
  }
  return pg_loss + kl_penalty, metrics


def behaviour_weights(
  prox_logp_bt: jax.Array,
  behaviour_logp_bt: jax.Array | None,
  mask_bt: jax.Array,
  cfg: LossConfig,
  segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Importance weights `pi_prox / pi_behaviour` as `cfg` applies them, and where they were
  truncated or masked. No gradient flows through them.

  `"truncate"`: `min(w, cap)`; `"mask"`: `w` inside `[1 / cap, cap]`, else 0. At sequence level
  `w` is the product of the sequence's token weights (a row's, or with `segment_ids_bt` a
  packed segment's), applied to all its tokens.
  """
  ones = jnp.ones(mask_bt.shape, jnp.float32)
  if cfg.behaviour_correction == "none" or behaviour_logp_bt is None:
    return ones, jnp.zeros(mask_bt.shape, bool)
  behaviour_logp_bt = jax.lax.stop_gradient(behaviour_logp_bt.astype(jnp.float32))
  log_w_bt = jnp.where(mask_bt, jax.lax.stop_gradient(prox_logp_bt) - behaviour_logp_bt, 0.0)
  if cfg.behaviour_level == "sequence":
    seqs = _Sequences.of(mask_bt.shape, segment_ids_bt)
    log_w_bt = seqs.spread(seqs.sum(log_w_bt), mask_bt.shape)
  log_cap = jnp.log(jnp.float32(cfg.behaviour_cap))
  if cfg.behaviour_correction == "truncate":
    adjusted_bt = log_w_bt > log_cap
    return jnp.exp(jnp.minimum(log_w_bt, log_cap)), adjusted_bt
  adjusted_bt = jnp.abs(log_w_bt) > log_cap
  # Clamp before exp so that a huge log-weight that is masked anyway cannot become inf * 0.
  return jnp.where(adjusted_bt, 0.0, jnp.exp(jnp.clip(log_w_bt, -log_cap, log_cap))), adjusted_bt
