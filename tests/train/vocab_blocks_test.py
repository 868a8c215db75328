"""Log-probs and entropies through the LM head a block of vocabulary rows at a time
(`jaxrl.train.vocab_blocks`): several blocks and a partial last one, both head layouts, the
vocabulary mask, temperature; forward against float64, gradients (of log-probs and
entropies) against autodiff of the whole-vocabulary computation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import LMHead
from jaxrl.model.transformer import softcap, vocab_mask
from jaxrl.train import update_plan
from jaxrl.train.losses import chunked_token_logprobs
from jaxrl.train.vocab_blocks import vocab_block_logprobs, vocab_block_rows

B, T, D, V = 2, 9, 16, 400  # 400 rows: blocks of 128 leave a partial one of 16


def _inputs(seed, vocab_limit=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(B, T, D)), dtype)
  head_dv = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab_limit or V, (B, T)), jnp.int32)
  return hidden, head_dv, targets


def _head(head_dv, vocab_major):
  # A tied embedding's head is `[v, d]`, used as stored: the same values, the other layout.
  return LMHead(head_dv.T, vocab_major=True) if vocab_major else LMHead(head_dv, False)


def _whole(hidden, head, targets, temperature, vocab_limit, cap=0.0):
  """The whole-vocabulary computation, as the model's logits: compute dtype, then float32,
  then the softcap."""
  logits = softcap(head.logits(hidden).astype(jnp.float32), cap)
  logits = vocab_mask(logits, vocab_limit) / temperature
  logz = jax.nn.logsumexp(logits, axis=-1)
  logp_all = logits - logz[..., None]
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  return logp, -jnp.sum(jnp.exp(logp_all) * logits, -1) + logz


def test_block_rows_bound_the_logits_like_chunks_of_positions():
  assert vocab_block_rows(151936, 4096, 128) == 4864  # 4748.0 rounded up to 128s
  assert vocab_block_rows(151936, 128, 128) == 151936  # short rows: one block
  assert vocab_block_rows(151936, 1 << 20, 1) == 128  # never below 128 rows
  assert vocab_block_rows(100, 8, 512) == 100  # never above the vocabulary


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("vocab_limit", [0, 300, 390])
def test_forward_matches_float64(vocab_major, vocab_limit):
  """Limits 300 and 390 mask a whole block past the limit, and part of the last one."""
  hidden, head_dv, targets = _inputs(vocab_limit, vocab_limit)
  logp, entropy = vocab_block_logprobs(
    hidden, _head(head_dv, vocab_major), targets, 0.7, vocab_limit=vocab_limit, rows=128
  )
  logits = np.asarray(hidden, np.float64) @ np.asarray(head_dv, np.float64) / 0.7
  if vocab_limit:
    logits[..., vocab_limit:] = -np.inf
  top = logits.max(-1, keepdims=True)
  logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  logp_all = logits - logz[..., None]
  want_logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
  probs = np.exp(logp_all)
  with np.errstate(invalid="ignore"):  # 0 * -inf at masked ids, dropped by the where
    want_entropy = -np.where(probs > 0, probs * logp_all, 0.0).sum(-1)
  scale = (np.abs(np.asarray(hidden)) @ np.abs(np.asarray(head_dv))).max() / 0.7
  tolerance.assert_close(logp, want_logp, n=D + V, scale=scale, exact=True, err_msg="logp")
  tolerance.assert_close(entropy, want_entropy, n=D + V, scale=scale, exact=True)


@pytest.mark.parametrize(
  "vocab_major, vocab_limit, terms",
  [(False, 0, "both"), (True, 0, "both"), (False, 390, "both"), (True, 390, "logp"),
   (False, 0, "entropy")],
)  # fmt: skip
def test_gradients_match_autodiff_of_the_whole_vocabulary(vocab_major, vocab_limit, terms):
  """Of a loss that weighs log-probs and entropies (an entropy bonus), or only one of them
  (the other's cotangent a symbolic zero, its term left out), in the hidden states and the
  head, float32."""
  hidden, head_dv, targets = _inputs(7 + vocab_limit, vocab_limit)
  if vocab_limit:  # a target past the limit: its logit is a constant, it passes no gradient
    targets = targets.at[0, 0].set(V - 1)
  rng = np.random.default_rng(3)
  w_logp = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
  w_entropy = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)

  def loss(stats):
    def fn(h, w):
      logp, entropy = stats(h, _head(w, vocab_major))
      if terms == "logp":
        entropy = jax.lax.stop_gradient(entropy)
      if terms == "entropy":
        logp = jax.lax.stop_gradient(logp)
      return jnp.sum(logp * w_logp) + jnp.sum(entropy * w_entropy)

    return jax.grad(fn, argnums=(0, 1))(hidden, head_dv)

  got = loss(
    lambda h, head: vocab_block_logprobs(h, head, targets, 0.7, vocab_limit=vocab_limit, rows=128)
  )
  want = loss(lambda h, head: _whole(h, head, targets, 0.7, vocab_limit))
  # Forward over d and v, back over v (hidden's gradient) or over the b * t tokens (head's).
  for name, g, w in zip(("hidden", "head"), got, want, strict=True):
    tolerance.assert_close(g, w, n=D + V + B * T, err_msg=name)


def test_bf16_hidden_states_give_the_models_logits_and_float32_head_gradients():
  """bf16 compute on a float32 head (the learner's master weights): the logits are the
  model's (bf16, then float32), the head's gradient comes back in float32, and agrees with
  autodiff of the whole-vocabulary computation to bf16 rounding."""
  hidden, head_dv, targets = _inputs(5, dtype=jnp.bfloat16)
  head = LMHead(head_dv, vocab_major=False)
  logp, _ = vocab_block_logprobs(hidden, head, targets, 1.0, rows=128)
  want, _ = _whole(hidden, head, targets, 1.0, 0)
  tolerance.assert_close(logp, want, n=V, scale=float(jnp.abs(want).max()) + 10.0)

  def grads(stats):
    return jax.grad(lambda h, w: jnp.sum(stats(h, LMHead(w, False))[0]), argnums=(0, 1))(
      hidden, head_dv
    )

  got = grads(lambda h, head: vocab_block_logprobs(h, head, targets, 1.0, rows=128))
  want = grads(lambda h, head: _whole(h, head, targets, 1.0, 0))
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
  for name, g, w in zip(("hidden", "head"), got, want, strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    # Both round the logits' gradient to bf16 before the matmuls; the whole computation
    # also rounds its head gradient to bf16, so a few bf16 ulps of the largest entry.
    np.testing.assert_allclose(g, w, atol=4 * 2.0**-8 * np.abs(w).max(), err_msg=name)


def test_chunked_token_logprobs_runs_blocks_of_chunk_positions_worth():
  """`chunk` positions of the whole vocabulary: 400 x 3 / 9 -> 134 rows -> 256, two blocks."""
  hidden, head_dv, targets = _inputs(11)
  head = LMHead(head_dv, vocab_major=False)
  got = chunked_token_logprobs(hidden, head, targets, 0.7, chunk=3)
  assert vocab_block_rows(V, T, 3) == 256
  want = vocab_block_logprobs(hidden, head, targets, 0.7, rows=256)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    chunked_token_logprobs(hidden, head, targets, chunk=0)


def _gathered_elements(hlo_text: str) -> list[int]:
  """Element counts of the results of the all-gathers in a compiled program's HLO text."""
  gathers = update_plan.collective_results(hlo_text)
  return [math.prod(shape) for c in gathers if c.kind == "all-gather" for shape in c.shapes]


@pytest.mark.parametrize("vocab_major", [False, True])
def test_a_head_sharded_over_its_vocabulary_is_never_gathered(vocab_major):
  """Tensor parallelism (the vocabulary over 4 devices): with `shards=4` every block takes its
  rows from every shard, so the gradient's program gathers no head-sized array (with one
  shard's view it gathers the whole head), and the results are the one-device ones."""
  v, d, t = 1024, 64, 128
  rng = np.random.default_rng(2)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tensor",))
  spec = jax.sharding.PartitionSpec(*(("tensor", None) if vocab_major else (None, "tensor")))
  shape = (v, d) if vocab_major else (d, v)
  head = jnp.asarray(rng.normal(size=shape) * 0.1, jnp.float32)
  hidden = jnp.asarray(rng.normal(size=(2, t, d)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (2, t)), jnp.int32)

  def grads(shards):
    def loss(w, h):
      logp, entropy = vocab_block_logprobs(
        h, LMHead(w, vocab_major), targets, 0.7, rows=128, shards=shards
      )
      return jnp.sum(logp) + jnp.sum(entropy)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))

  sharded = jax.device_put(head, jax.sharding.NamedSharding(mesh, spec))
  for shards, gathers_head in ((4, False), (1, True)):
    hlo = grads(shards).lower(sharded, hidden).compile().as_text()
    assert (max(_gathered_elements(hlo), default=0) >= v * d // 2) == gathers_head, shards
  got = grads(4)(sharded, hidden)
  want = grads(1)(head, hidden)
  for name, g, w in zip(("head", "hidden"), got, want, strict=True):
    tolerance.assert_close(g, w, n=d + v + 2 * t, err_msg=name)


@pytest.mark.parametrize("vocab_major, vocab_limit", [(False, 0), (True, 390)])
def test_softcapped_logits_match_the_whole_vocabulary(vocab_major, vocab_limit):
  """Gemma 2's final softcap (`c * tanh(logits / c)`, c = 2 here, where the logits' spread is
  about 2, so many saturate): log-probs, entropies and their gradients as autodiff of the
  whole-vocabulary computation gives them; the cap changes them far beyond the tolerance."""
  hidden, head_dv, targets = _inputs(11, vocab_limit)
  stats = {
    "blocks": lambda h, w, cap: vocab_block_logprobs(
      h, _head(w, vocab_major), targets, 0.7, vocab_limit=vocab_limit, rows=128,
      logit_softcap=cap,
    ),
    "whole": lambda h, w, cap: _whole(h, _head(w, vocab_major), targets, 0.7, vocab_limit, cap),
  }  # fmt: skip
  got, want = (stats[k](hidden, head_dv, 2.0) for k in ("blocks", "whole"))
  uncapped, _ = stats["whole"](hidden, head_dv, 0.0)
  for g, w in zip(got, want, strict=True):
    tolerance.assert_close(g, w, n=D + V, scale=float(jnp.abs(w).max()))
  assert float(jnp.abs(uncapped - want[0]).max()) > 0.5

  def grads(kind):
    def fn(h, w):
      logp, entropy = stats[kind](h, w, 2.0)
      return jnp.sum(logp * jnp.cos(logp)) + jnp.sum(entropy)

    return jax.grad(fn, argnums=(0, 1))(hidden, head_dv)

  for name, g, w in zip(("hidden", "head"), grads("blocks"), grads("whole"), strict=True):
    tolerance.assert_close(g, w, n=D + V + B * T, err_msg=name)
