"""Token log-probabilities, the PPO clipped policy loss and the k3 KL penalty.

Shape suffixes: b = sequences in the (micro-)batch, t = tokens, v = vocabulary.

Every loss and metric here is a SUM over the micro-batch divided by a count over the WHOLE batch
(`num_tokens`, `num_seqs`), so summing a quantity over the micro-batches of a batch (gradient
accumulation, or data-parallel shards followed by a psum) gives exactly that quantity for the
whole batch.
"""

import dataclasses

import jax
import jax.numpy as jnp

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


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
  """

  clip_low: float = 0.2
  clip_high: float = 0.2
  aggregation: str = "token-mean"
  kl_weight: float = 0.0

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


def _aggregate(
  value_bt: jax.Array,
  mask_bt: jax.Array,
  aggregation: str,
  num_tokens: jax.Array | float,
  num_seqs: jax.Array | float,
) -> jax.Array:
  """Sums `value_bt` over masked tokens, normalised by whole-batch counts (see module doc)."""
  value_bt = jnp.where(mask_bt, value_bt, 0.0)
  if aggregation == "token-mean":
    return value_bt.sum() / jnp.maximum(num_tokens, 1.0)
  # seq-mean-token-mean: a sequence with no masked tokens has sum 0 and so contributes 0.
  seq_len_b = jnp.maximum(mask_bt.sum(axis=1), 1)
  return (value_bt.sum(axis=1) / seq_len_b).sum() / jnp.maximum(num_seqs, 1.0)


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clipped surrogate loss (plus an optional k3 KL penalty) of one micro-batch.

  Per token, with `ratio = exp(logp - old_logp)` and the sequence's advantage `A`:
  `loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
  + kl_weight * k3(logp, ref_logp)`, aggregated over the masked tokens as `cfg.aggregation` says.

  Normalisation uses whole-batch counts, so that the sum of the returned loss over the
  micro-batches of a batch is the loss of the whole batch (and likewise its gradient):
    - `token-mean`: `sum_masked(loss_t) / num_tokens`.
    - `seq-mean-token-mean`: `sum_seqs(mean_masked_in_seq(loss_t)) / num_seqs`; a sequence with
      no masked tokens contributes 0.

  Args:
    logp_bt: `[B, T]` log-probs of the sampled tokens under the policy being trained.
    old_logp_bt: `[B, T]` log-probs under the policy that sampled them (no gradient).
    advantages_b: `[B]` one advantage per sequence (no gradient).
    mask_bt: `[B, T]` bool (or 0/1): the tokens that count (completion tokens, not padding or
      prompt). Values at unmasked positions are ignored, even if inf or NaN.
    cfg: clip range, aggregation and KL weight.
    num_tokens: masked tokens in the WHOLE batch, across all micro-batches.
    num_seqs: sequences in the WHOLE batch, across all micro-batches.
    ref_logp_bt: `[B, T]` reference-policy log-probs (no gradient); required if
      `cfg.kl_weight > 0`.

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

  Raises:
    ValueError: `cfg.kl_weight > 0` without `ref_logp_bt`, or mismatched shapes.
  """
  if cfg.kl_weight > 0 and ref_logp_bt is None:
    raise ValueError(
      f"LossConfig.kl_weight={cfg.kl_weight} > 0 needs ref_logp_bt (reference-policy log-probs)."
    )
  shapes = {"logp_bt": logp_bt.shape, "old_logp_bt": old_logp_bt.shape, "mask_bt": mask_bt.shape}
  if ref_logp_bt is not None:
    shapes["ref_logp_bt"] = ref_logp_bt.shape
  if len(set(shapes.values())) != 1 or len(logp_bt.shape) != 2:
    raise ValueError(f"Expected equal [B, T] shapes, got {shapes}.")
  if advantages_b.shape != logp_bt.shape[:1]:
    raise ValueError(
      f"advantages_b must be [B]={logp_bt.shape[:1]} (one per sequence), got {advantages_b.shape}."
    )

  mask_bt = jnp.asarray(mask_bt) != 0
  logp_bt = logp_bt.astype(jnp.float32)
  old_logp_bt = jax.lax.stop_gradient(old_logp_bt.astype(jnp.float32))
  adv_b1 = jax.lax.stop_gradient(advantages_b.astype(jnp.float32))[:, None]
  inv_tokens = 1.0 / jnp.maximum(num_tokens, 1.0)

  # Zero the log-ratio where masked, before exp, so that padding garbage cannot overflow to inf
  # and turn the masked sum (or its gradient) into NaN.
  ratio_bt = jnp.exp(jnp.where(mask_bt, logp_bt - old_logp_bt, 0.0))
  clipped_ratio_bt = jnp.clip(ratio_bt, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  pg_loss_bt = -jnp.minimum(ratio_bt * adv_b1, clipped_ratio_bt * adv_b1)
  is_clipped_bt = ((adv_b1 > 0) & (ratio_bt > 1.0 + cfg.clip_high)) | (
    (adv_b1 < 0) & (ratio_bt < 1.0 - cfg.clip_low)
  )
  pg_loss = _aggregate(pg_loss_bt, mask_bt, cfg.aggregation, num_tokens, num_seqs)

  if ref_logp_bt is None:
    kl_tok = jnp.zeros((), jnp.float32)
    kl_penalty = jnp.zeros((), jnp.float32)
  else:
    ref_logp_bt = jax.lax.stop_gradient(ref_logp_bt.astype(jnp.float32))
    kl_bt = kl_k3(jnp.where(mask_bt, logp_bt, 0.0), jnp.where(mask_bt, ref_logp_bt, 0.0))
    kl_tok = jnp.where(mask_bt, kl_bt, 0.0).sum() * inv_tokens
    kl_penalty = cfg.kl_weight * _aggregate(kl_bt, mask_bt, cfg.aggregation, num_tokens, num_seqs)

  metrics = {
    "pg_loss": pg_loss,
    "kl_penalty": kl_penalty,
    "kl": kl_tok,
    "clip_frac": (is_clipped_bt & mask_bt).sum() * inv_tokens,
    "ratio_mean": jnp.where(mask_bt, ratio_bt, 0.0).sum() * inv_tokens,
  }
  return pg_loss + kl_penalty, metrics
