"""Tests for jaxrl.train.losses.

Shape suffixes: b = sequences, t = tokens, v = vocabulary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.train import losses

CLIP_HIGHER = losses.LossConfig(clip_low=0.2, clip_high=0.28)


def _hand_example():
  """Two sequences of three tokens; the last token of sequence 1 is padding.

  clip range [0.8, 1.28]. Sequence 0 has A = +1, sequence 1 has A = -2:
    seq 0, ratio 1.1: inside                     -> -min(1.1, 1.1)        = -1.1
    seq 0, ratio 1.5: above, A > 0: clipped      -> -min(1.5, 1.28)       = -1.28
    seq 0, ratio 0.5: below, A > 0: not clipped  -> -min(0.5, 0.8)        = -0.5
    seq 1, ratio 0.9: inside                     -> -min(-1.8, -1.8)      =  1.8
    seq 1, ratio 0.5: below, A < 0: clipped      -> -min(-1.0, -1.6)      =  1.6
    seq 1, padding (log-ratio 200 would overflow exp) -> ignored.
  """
  ratio_bt = np.array([[1.1, 1.5, 0.5], [0.9, 0.5, 1.0]], np.float32)
  old_logp_bt = np.array([[-0.3, -2.0, -1.2], [-0.7, -4.0, -100.0]], np.float32)
  logp_bt = np.log(ratio_bt) + old_logp_bt
  logp_bt[1, 2] = 100.0
  mask_bt = np.array([[1, 1, 1], [1, 1, 0]], bool)
  adv_b = np.array([1.0, -2.0], np.float32)
  return jnp.asarray(logp_bt), jnp.asarray(old_logp_bt), jnp.asarray(adv_b), jnp.asarray(mask_bt)


def test_hand_example_token_mean_clip_higher():
  logp, old, adv, mask = _hand_example()
  loss, metrics = losses.policy_loss(logp, old, adv, mask, CLIP_HIGHER, num_tokens=5, num_seqs=2)
  # (-1.1 - 1.28 - 0.5 + 1.8 + 1.6) / 5 = 0.52 / 5
  np.testing.assert_allclose(loss, 0.104, atol=1e-6)
  np.testing.assert_allclose(metrics["pg_loss"], 0.104, atol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac"], 2 / 5, atol=1e-6)
  np.testing.assert_allclose(metrics["ratio_mean"], (1.1 + 1.5 + 0.5 + 0.9 + 0.5) / 5, atol=1e-6)
  assert float(metrics["kl"]) == 0.0 and float(metrics["kl_penalty"]) == 0.0


def test_hand_example_symmetric_clip():
  logp, old, adv, mask = _hand_example()
  loss, _ = losses.policy_loss(logp, old, adv, mask, losses.LossConfig(), num_tokens=5, num_seqs=2)
  # Only the ratio-1.5 token changes: clipped at 1.2 instead of 1.28.
  # (-1.1 - 1.2 - 0.5 + 1.8 + 1.6) / 5 = 0.6 / 5
  np.testing.assert_allclose(loss, 0.12, atol=1e-6)


def test_hand_example_seq_mean_token_mean():
  logp, old, adv, mask = _hand_example()
  cfg = losses.LossConfig(clip_high=0.28, aggregation="seq-mean-token-mean")
  loss, _ = losses.policy_loss(logp, old, adv, mask, cfg, num_tokens=5, num_seqs=2)
  # seq 0: (-1.1 - 1.28 - 0.5) / 3 = -0.96; seq 1: (1.8 + 1.6) / 2 = 1.7; (-0.96 + 1.7) / 2
  np.testing.assert_allclose(loss, 0.37, atol=1e-6)


def test_hand_example_gradient():
  logp, old, adv, mask = _hand_example()
  grad_bt = jax.grad(
    lambda lp: losses.policy_loss(lp, old, adv, mask, CLIP_HIGHER, num_tokens=5, num_seqs=2)[0]
  )(logp)
  # d/dlogp of -ratio * A is -A * ratio on unclipped tokens; clipped tokens and padding get 0.
  expected_bt = np.array([[-1.1, 0.0, -0.5], [2 * 0.9, 0.0, 0.0]]) / 5
  np.testing.assert_allclose(grad_bt, expected_bt, atol=1e-6)


def _reference_loss(logp, old, adv, mask, cfg, ref=None):
  """Loops over sequences and tokens in numpy; whole-batch version of policy_loss."""
  logp, old, adv, mask = (np.asarray(x, np.float64) for x in (logp, old, adv, mask))
  ref = None if ref is None else np.asarray(ref, np.float64)
  per_seq, tokens = [], []
  for b in range(logp.shape[0]):
    seq = []
    for t in range(logp.shape[1]):
      if not mask[b, t]:
        continue
      ratio = np.exp(logp[b, t] - old[b, t])
      clipped = min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high)
      value = -min(ratio * adv[b], clipped * adv[b])
      if ref is not None:
        r = ref[b, t] - logp[b, t]
        value += cfg.kl_weight * (np.exp(r) - r - 1)
      seq.append(value)
    tokens += seq
    per_seq.append(np.mean(seq) if seq else 0.0)
  if cfg.aggregation == "token-mean":
    return np.sum(tokens) / len(tokens)
  return np.sum(per_seq) / len(per_seq)


def _random_batch(seed, b=8, t=16):
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(seed), 5)
  old_bt = -jax.random.exponential(k1, (b, t)) * 2.0
  logp_bt = old_bt + 0.4 * jax.random.normal(k2, (b, t))  # ratios on both sides of the clip
  ref_bt = old_bt + 0.3 * jax.random.normal(k3, (b, t))
  adv_b = jax.random.normal(k4, (b,))
  lengths_b = jax.random.randint(k5, (b,), 1, t + 1).at[2].set(0)  # one fully padded sequence
  mask_bt = jnp.arange(t)[None, :] < lengths_b[:, None]
  return logp_bt, old_bt, adv_b, mask_bt, ref_bt


@pytest.mark.parametrize("aggregation", losses.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("kl_weight", [0.0, 0.1])
def test_random_batch_matches_numpy_reference(aggregation, kl_weight):
  logp, old, adv, mask, ref = _random_batch(seed=3)
  cfg = losses.LossConfig(
    clip_low=0.2, clip_high=0.28, aggregation=aggregation, kl_weight=kl_weight
  )
  loss, metrics = losses.policy_loss(
    logp, old, adv, mask, cfg, num_tokens=mask.sum(), num_seqs=8, ref_logp_bt=ref
  )
  expected = _reference_loss(logp, old, adv, mask, cfg, ref if kl_weight else None)
  scale = tolerance.policy_loss_scale(logp, old, adv, mask, ref_logp_bt=ref, kl_weight=kl_weight)
  tolerance.assert_close(loss, expected, n=mask.size, scale=scale, exact=True)
  np.testing.assert_allclose(loss, metrics["pg_loss"] + metrics["kl_penalty"], rtol=1e-6)
  assert 0.0 < float(metrics["clip_frac"]) < 1.0


@pytest.mark.parametrize("aggregation", losses.LOSS_AGGREGATIONS)
def test_micro_batches_sum_to_full_batch(aggregation):
  logp, old, adv, mask, ref = _random_batch(seed=7)
  cfg = losses.LossConfig(clip_high=0.28, aggregation=aggregation, kl_weight=0.05)
  num_tokens, num_seqs = mask.sum(), 8

  @jax.jit
  def loss_and_grad(logp, old, adv, mask, ref):
    def loss_fn(lp):
      return losses.policy_loss(
        lp, old, adv, mask, cfg, num_tokens=num_tokens, num_seqs=num_seqs, ref_logp_bt=ref
      )

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)

  (full_loss, full_metrics), full_grad = loss_and_grad(logp, old, adv, mask, ref)
  # Uneven micro-batches, one of which holds the fully padded sequence.
  total_loss, total_metrics, grads = 0.0, dict.fromkeys(full_metrics, 0.0), []
  for sl in [slice(0, 3), slice(3, 4), slice(4, 8)]:
    (loss, metrics), grad = loss_and_grad(logp[sl], old[sl], adv[sl], mask[sl], ref[sl])
    total_loss += loss
    total_metrics = {k: total_metrics[k] + metrics[k] for k in metrics}
    grads.append(grad)
  # The loss and pg_loss sum terms of either sign; the other metrics positive ones (or count),
  # whose size is the result's own.
  scale = tolerance.policy_loss_scale(logp, old, adv, mask, ref_logp_bt=ref, kl_weight=0.05)
  tolerance.assert_close(total_loss, full_loss, n=mask.size, scale=scale)
  for k in full_metrics:
    k_scale = scale if k == "pg_loss" else None
    tolerance.assert_close(total_metrics[k], full_metrics[k], n=mask.size, scale=k_scale, err_msg=k)
  np.testing.assert_allclose(jnp.concatenate(grads), full_grad, rtol=1e-5, atol=1e-8)
  assert float(jnp.abs(full_grad).sum()) > 0


def test_padding_garbage_keeps_loss_and_grads_finite():
  logp, old, adv, mask, ref = _random_batch(seed=11)
  logp = jnp.where(mask, logp, 500.0)
  old = jnp.where(mask, old, jnp.nan)
  ref = jnp.where(mask, ref, -jnp.inf)
  cfg = losses.LossConfig(kl_weight=0.1, aggregation="seq-mean-token-mean")

  def loss_fn(lp):
    return losses.policy_loss(
      lp, old, adv, mask, cfg, num_tokens=mask.sum(), num_seqs=8, ref_logp_bt=ref
    )

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
  assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
  assert np.all(np.isfinite(grad))
  np.testing.assert_array_equal(np.where(mask, 0.0, grad), 0.0)


def test_kl_k3():
  logp = -jax.random.exponential(jax.random.key(0), (4, 9))
  np.testing.assert_array_equal(losses.kl_k3(logp, logp), 0.0)
  ref = logp + jax.random.normal(jax.random.key(1), (4, 9))
  assert np.all(losses.kl_k3(logp, ref) > 0)
  # logp = log 0.5, ref = log 0.25: r = log 0.5; exp(r) - r - 1 = 0.5 + log 2 - 1
  np.testing.assert_allclose(
    losses.kl_k3(jnp.log(0.5), jnp.log(0.25)), 0.5 + np.log(2) - 1, rtol=1e-6
  )


def test_kl_in_policy_loss_hand_computed():
  # One sequence, two tokens, A = 0 so only the KL is left; token 1 is masked out.
  logp = jnp.log(jnp.array([[0.5, 0.5]]))
  ref = jnp.log(jnp.array([[0.25, 0.9]]))
  cfg = losses.LossConfig(kl_weight=0.5)
  loss, metrics = losses.policy_loss(
    logp,
    logp,
    jnp.zeros(1),
    jnp.array([[True, False]]),
    cfg,
    num_tokens=1,
    num_seqs=1,
    ref_logp_bt=ref,
  )
  kl = 0.5 + np.log(2) - 1
  np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.5 * kl, rtol=1e-6)
  np.testing.assert_allclose(metrics["pg_loss"], 0.0, atol=1e-7)


def test_kl_weight_without_reference_raises():
  logp, old, adv, mask = _hand_example()
  with pytest.raises(ValueError, match="kl_weight=0.1 > 0 needs ref_logp_bt"):
    losses.policy_loss(
      logp, old, adv, mask, losses.LossConfig(kl_weight=0.1), num_tokens=5, num_seqs=2
    )


def test_shape_errors():
  logp, old, adv, mask = _hand_example()
  cfg = losses.LossConfig()
  with pytest.raises(ValueError, match="equal"):
    losses.policy_loss(logp, old[:, :2], adv, mask, cfg, num_tokens=5, num_seqs=2)
  with pytest.raises(ValueError, match="advantages_b"):
    losses.policy_loss(logp, old, adv[:1], mask, cfg, num_tokens=5, num_seqs=2)


@pytest.mark.parametrize(
  ("kwargs", "field"),
  [
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_low": -0.1}, "clip_low"),
    ({"clip_high": -0.1}, "clip_high"),
    ({"aggregation": "sum"}, "aggregation"),
    ({"kl_weight": -1.0}, "kl_weight"),
    ({"ratio_level": "group"}, "ratio_level"),
    ({"proximal": "old"}, "proximal"),
    ({"behaviour_correction": "truncate"}, "behaviour_correction"),  # needs recompute
    ({"proximal": "recompute", "behaviour_correction": "clip"}, "behaviour_correction"),
    ({"behaviour_level": "batch"}, "behaviour_level"),
    ({"behaviour_cap": 1.0}, "behaviour_cap"),
  ],
)
def test_loss_config_validation(kwargs, field):
  with pytest.raises(ValueError, match=f"LossConfig.{field}"):
    losses.LossConfig(**kwargs)


def _np_log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _assert_log_softmax_close(logp_bt, expected_bt, full_btv):
  """A log-softmax over v logits rounds like a v-term sum of terms the size of the (scaled)
  logits, which are at most max|log-prob| apart from each other."""
  scale = np.abs(full_btv).max()
  tolerance.assert_close(logp_bt, expected_bt, n=full_btv.shape[-1], scale=scale, exact=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_numpy(temperature):
  k1, k2 = jax.random.split(jax.random.key(5))
  logits_btv = jax.random.normal(k1, (3, 5, 11)) * 4.0
  targets_bt = jax.random.randint(k2, (3, 5), 0, 11)
  logp_bt = losses.token_logprobs(logits_btv, targets_bt, temperature)
  full_btv = _np_log_softmax(np.asarray(logits_btv, np.float64) / temperature)
  expected_bt = np.take_along_axis(full_btv, np.asarray(targets_bt)[..., None], axis=-1)[..., 0]
  assert logp_bt.shape == (3, 5) and logp_bt.dtype == jnp.float32
  _assert_log_softmax_close(logp_bt, expected_bt, full_btv)


def test_token_logprobs_bf16_logits_computed_in_fp32():
  k1, k2 = jax.random.split(jax.random.key(6))
  logits_btv = (jax.random.normal(k1, (2, 4, 300)) * 3.0).astype(jnp.bfloat16)
  targets_bt = jax.random.randint(k2, (2, 4), 0, 300)
  logp_bt = jax.jit(losses.token_logprobs)(logits_btv, targets_bt)
  assert logp_bt.dtype == jnp.float32
  # Exact fp32 answer for the bf16 values; a bf16 log-softmax would be off by ~1e-2.
  full_btv = _np_log_softmax(np.asarray(logits_btv.astype(jnp.float32), np.float64))
  expected_bt = np.take_along_axis(full_btv, np.asarray(targets_bt)[..., None], axis=-1)[..., 0]
  _assert_log_softmax_close(logp_bt, expected_bt, full_btv)


def test_token_logprobs_bad_temperature():
  with pytest.raises(ValueError, match="temperature must be > 0"):
    losses.token_logprobs(jnp.ones((1, 1, 2)), jnp.zeros((1, 1), jnp.int32), 0.0)


def test_gspo_sequence_ratio_and_gradient():
  logp, old, adv, mask, _ = _random_batch(seed=int(np.random.default_rng().integers(1 << 30)))
  logp = old + 0.01 * (logp - old)  # small log-ratios: sequence ratios inside a wide clip
  cfg = losses.LossConfig(
    clip_low=0.5, clip_high=0.5, ratio_level="sequence", aggregation="seq-mean-token-mean"
  )
  num_seqs = 8

  def loss_fn(lp):
    return losses.policy_loss(lp, old, adv, mask, cfg, num_tokens=mask.sum(), num_seqs=num_seqs)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
  m, lp, od, a = (np.asarray(x, np.float64) for x in (mask, logp, old, adv))
  lengths = m.sum(1)
  s_b = np.exp(np.where(m > 0, lp - od, 0).sum(1) / np.maximum(lengths, 1))
  # Unclipped: each sequence's loss is -s A; empty sequences contribute 0.
  expected = np.sum(np.where(lengths > 0, -s_b * a, 0.0)) / num_seqs
  # Terms of either sign; each sequence ratio is at most its largest token ratio.
  scale = tolerance.policy_loss_scale(logp, old, adv, mask)
  tolerance.assert_close(loss, expected, n=mask.shape[1] + num_seqs, scale=scale, exact=True)
  # d(-s A / num_seqs) / d logp_t = -A s / (len * num_seqs) on the sequence's masked tokens.
  g = -a * s_b / np.maximum(lengths, 1) / num_seqs
  np.testing.assert_allclose(grad, np.where(m > 0, g[:, None], 0.0), rtol=1e-4, atol=1e-7)
  assert float(metrics["clip_frac"]) == 0.0


def _behaviour_case(rng, b=6, t=10):
  prox = -rng.exponential(2.0, (b, t)).astype(np.float32)
  behaviour = (prox + rng.normal(0.0, 0.8, (b, t))).astype(np.float32)
  logp = (prox + rng.normal(0.0, 0.05, (b, t))).astype(np.float32)
  mask = np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None]
  adv = rng.normal(size=b).astype(np.float32)
  # Pin both sides of the cap for every level: row 0's weights are e per token (over the cap),
  # row 1's are exactly 1 (inside it); the other rows stay random.
  behaviour[0] = prox[0] - 1.0
  behaviour[1] = prox[1]
  return logp, prox, behaviour, adv, mask


@pytest.mark.parametrize("correction", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_behaviour_weights_match_numpy(correction, level):
  rng = np.random.default_rng()
  logp, prox, behaviour, adv, mask = _behaviour_case(rng)
  cfg = losses.LossConfig(
    clip_low=10.0**-9 + 0.2,
    proximal="recompute",
    behaviour_correction=correction,
    behaviour_level=level,
    behaviour_cap=1.5,
  )
  n = int(mask.sum())
  loss, metrics = losses.policy_loss(
    *map(jnp.asarray, (logp, prox, adv, mask)), cfg, num_tokens=n, num_seqs=6,
    behaviour_logp_bt=jnp.asarray(behaviour),
  )  # fmt: skip
  log_w = np.where(mask, prox - behaviour, 0.0).astype(np.float64)
  if level == "sequence":
    log_w = np.broadcast_to(log_w.sum(1, keepdims=True), log_w.shape)
  w = np.exp(log_w)
  if correction == "truncate":
    weight, adjusted = np.minimum(w, 1.5), w > 1.5
  else:
    adjusted = (w > 1.5) | (w < 1 / 1.5)
    weight = np.where(adjusted, 0.0, w)
  ratio = np.exp(np.where(mask, logp - prox, 0.0))
  surrogate = np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
  expected = np.sum(np.where(mask, -weight * surrogate, 0.0)) / n
  # Sums over tokens of weights, each exp of a log-ratio (a sum over the sequence's tokens at the
  # sequence level) and times a ratio: those round with the differences of log-probs they add.
  terms = mask.shape[1] + n
  log_ratios = np.where(mask, np.abs(prox - behaviour), 0.0).sum(1).max()
  logs = 1 + log_ratios + np.abs(logp - prox)[mask].max()
  scale = np.abs(weight * surrogate)[mask].max() * logs
  tolerance.assert_close(loss, expected, n=terms, scale=scale, exact=True)
  kept = weight[mask]
  w_scale = kept.max() * logs
  tolerance.assert_close(
    metrics["behaviour_weight_mean"], kept.mean(), n=terms, scale=w_scale, exact=True
  )
  sq_mean, sq_scale = (kept**2).mean(), 2 * kept.max() * w_scale
  tolerance.assert_close(
    metrics["behaviour_weight_sq_mean"], sq_mean, n=terms, scale=sq_scale, exact=True
  )
  np.testing.assert_allclose(metrics["behaviour_adjusted_frac"], adjusted[mask].mean(), rtol=1e-6)
  assert 0 < adjusted[mask].mean() < 1  # the case exercises both sides of the cap


def test_behaviour_correction_needs_behaviour_logprobs():
  logp, old, adv, mask, _ = _random_batch(seed=1)
  cfg = losses.LossConfig(proximal="recompute", behaviour_correction="truncate")
  with pytest.raises(ValueError, match="behaviour_logp_bt"):
    losses.policy_loss(logp, old, adv, mask, cfg, num_tokens=mask.sum(), num_seqs=8)
