"""Log-probs and entropies applied through the LM head in chunks, remat, and the vocabulary
mask: the same numbers as the plain computation (fp64 references), forward and backward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import LMHead, Model, get_preset
from jaxrl.model.transformer import MASKED_LOGIT, vocab_mask
from jaxrl.train.losses import chunked_token_logprobs, token_logprobs


def _reference_f64(hidden_btd, head_dv, targets_bt, temperature, vocab_limit):
  logits = np.asarray(hidden_btd, np.float64) @ np.asarray(head_dv, np.float64) / temperature
  if vocab_limit:
    logits[..., vocab_limit:] = -np.inf
  logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  logp_all = logits - logz[..., None]
  logp = np.take_along_axis(logp_all, np.asarray(targets_bt)[..., None], -1)[..., 0]
  probs = np.exp(logp_all)
  with np.errstate(invalid="ignore"):  # 0 * -inf at masked ids, dropped by the where
    entropy = -np.sum(np.where(probs > 0, probs * logp_all, 0.0), -1)
  return logp, entropy


@pytest.mark.parametrize("chunk,vocab_limit", [(4, 0), (5, 0), (64, 0), (3, 50)])
def test_chunked_matches_float64(chunk, vocab_limit):
  rng = np.random.default_rng(chunk + vocab_limit)
  b, t, d, v = 2, 13, 16, 64
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(d, v)) * 0.5, jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab_limit or v, (b, t)), jnp.int32)
  logp, entropy = chunked_token_logprobs(
    hidden, LMHead(head, vocab_major=False), targets, 0.7, vocab_limit=vocab_limit, chunk=chunk
  )
  want_logp, want_entropy = _reference_f64(hidden, head, targets, 0.7, vocab_limit)
  # Logits sum d products, the log-softmax and the entropy v terms of the logits' size (the
  # entropy weighs each log-prob's rounding by its probability): scaled by the largest logit's
  # sum of |products|.
  scale = (np.abs(np.asarray(hidden)) @ np.abs(np.asarray(head))).max() / 0.7
  tolerance.assert_close(logp, want_logp, n=d + v, scale=scale, exact=True, err_msg="logp")
  tolerance.assert_close(entropy, want_entropy, n=d + v, scale=scale, exact=True, err_msg="entropy")


@pytest.mark.parametrize("vocab_major", [False, True])
def test_chunked_gradient_matches_unchunked(vocab_major):
  rng = np.random.default_rng(1)
  b, t, d, v = 2, 11, 8, 32
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

  def chunked(h, w):
    # A tied embedding's head is `[v, d]`, used as stored: the same values, the other layout.
    head = LMHead(w.T, vocab_major=True) if vocab_major else LMHead(w, vocab_major=False)
    return jnp.sum(chunked_token_logprobs(h, head, targets, chunk=4)[0] * weights)

  def plain(h, w):
    return jnp.sum(token_logprobs(jnp.einsum("btd,dv->btv", h, w), targets) * weights)

  got = jax.grad(chunked, argnums=(0, 1))(hidden, head)
  want = jax.grad(plain, argnums=(0, 1))(hidden, head)
  # Forward over d and v, back over v (hidden's gradient) or over the b * t tokens (head's).
  for g, w in zip(got, want, strict=True):
    tolerance.assert_close(g, w, n=d + v + b * t)


def test_vocab_mask_masks_only_the_padded_rows():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 10)), jnp.float32)
  masked = vocab_mask(logits, 7)
  np.testing.assert_array_equal(masked[..., :7], logits[..., :7])
  assert bool(jnp.all(masked[..., 7:] == MASKED_LOGIT))
  assert vocab_mask(logits, 0) is logits


def test_model_masks_padded_vocabulary_and_remat_keeps_gradients():
  cfg = dataclasses.replace(get_preset("tiny"), vocab_limit=50)
  model, model_remat = Model(cfg), Model(dataclasses.replace(cfg, remat=True))
  params = model.init(0)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 50, (2, 12)), jnp.int32)
  logits, _ = model.apply(params, tokens)
  assert bool(jnp.all(logits[..., 50:] == MASKED_LOGIT))
  assert bool(jnp.all(jnp.argmax(logits, -1) < 50))

  def loss(p, m):
    hidden, _ = m.apply(p, tokens[:, :-1], return_hidden=True)
    logp, _ = chunked_token_logprobs(hidden, m.lm_head(p), tokens[:, 1:], vocab_limit=50, chunk=4)
    return -jnp.mean(logp)

  # The hidden-state path gives the logits' log-probs. Jitted: op by op, the gradients take
  # several times as long.
  np.testing.assert_allclose(
    jax.jit(loss, static_argnums=1)(params, model),
    -jnp.mean(token_logprobs(logits[:, :-1], tokens[:, 1:])),
    rtol=1e-6,
  )
  grad = jax.jit(jax.grad(loss), static_argnums=1)
  got, want = grad(params, model_remat), grad(params, model)
  # Recomputed activations may be summed in another order than the stored ones.
  terms = tolerance.model_terms(cfg, backward=True, tokens=tokens[:, 1:].size)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    tolerance.assert_close(g, w, n=terms)
