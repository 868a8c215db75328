"""Log-probabilities and entropies of target tokens through the LM head, a block of the
vocabulary at a time, with a hand-written gradient.

Applying the head a chunk of positions at a time (as `chunked_token_logprobs` did before)
reads the whole `[vocab, d]` head once per chunk forward, twice more per chunk backward, and
adds each chunk's head gradient into a running sum of the head's shape and dtype: for
Qwen3-0.6B's learner (float32 master weights, bf16 compute) at 4k positions in chunks of 128,
32 chunks each reading the 311 MB bf16 head three times and reading and writing the 622 MB
float32 sum: with the logits, about 83 GB of memory traffic a row against about 17 GB here
(docs/BENCHMARKS.md; with a bf16 head, 32 bf16 roundings of its gradient too). Here the
loop runs over blocks of vocabulary rows instead, every position at once:

- forward: an online log-sum-exp over the blocks (running max, sum of exponentials, and the
  exp-weighted sum of logits the entropy needs), and the target's logit from the block that
  holds it; the head is read once;
- backward (`jax.custom_vjp`): each block's logits again, their gradient from the saved
  log-sum-exp and entropy, the block's head gradient as one matmul over all positions
  (accumulated in float32 inside the matmul, written once) and the hidden states' gradient
  summed over blocks in float32; the head is read twice.

Numbers: a block's logits are the head's, `LMHead.logits` in the hidden states' dtype, then
float32, masked past `vocab_limit` and divided by the temperature, exactly as the rollout
engine computes them; only the order of the log-sum-exp's sums changes.

Shapes: b batch, t positions, d model width, v vocabulary rows, w rows per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxrl.model.transformer import MASKED_LOGIT, LMHead

_LANES = 128  # blocks are whole multiples of this many rows (TPU lanes, GPU tiles)


def vocab_block_rows(vocab: int, positions: int, chunk: int) -> int:
  """Rows per vocabulary block: the float32 logits of `positions` x that many rows hold about
  what `chunk` positions x the whole vocabulary did (the memory `chunk` has always bounded),
  rounded up to a multiple of 128 and at most the vocabulary."""
  rows = -(-chunk * vocab // max(positions, 1))
  return min(vocab, max(_LANES, -(-rows // _LANES) * _LANES))


def _rows(weights, vocab_major: bool, start, size: int):
  axis = 0 if vocab_major else 1
  if isinstance(start, int):
    return jax.lax.slice_in_dim(weights, start, start + size, axis=axis)
  return jax.lax.dynamic_slice_in_dim(weights, start, size, axis=axis)


def _block_logits(h_btd, weights, vocab_major, start, size, temperature, vocab_limit):
  """(float32 logits `[b, t, w]` of rows `[start, start + size)` as the model computes them,
  their row ids `[w]`)."""
  w_rows = _rows(weights, vocab_major, start, size)
  logits_btw = LMHead(w_rows, vocab_major).logits(h_btd).astype(jnp.float32)
  ids_w = start + jnp.arange(size, dtype=jnp.int32)
  if vocab_limit:
    logits_btw = jnp.where(ids_w < vocab_limit, logits_btw, MASKED_LOGIT)
  return logits_btw / temperature, ids_w


def _starts(vocab: int, rows: int):
  """(int32 starts of the whole blocks, for a loop; the start and size of the last, partial
  block, or None)."""
  whole, tail = divmod(vocab, rows)
  starts = jnp.arange(whole, dtype=jnp.int32) * rows
  return starts, ((whole * rows, tail) if tail else None)


def _forward(h_btd, weights, targets_bt, temperature, *, vocab_major, vocab_limit, rows):
  """(log-probs, entropies, log-sum-exp), float32 `[b, t]`."""
  vocab = weights.shape[0 if vocab_major else 1]
  block = functools.partial(
    _block_logits, h_btd, weights, vocab_major, temperature=temperature, vocab_limit=vocab_limit
  )

  def add(carry, start, size):
    max_bt, sum_bt, weighted_bt, target_bt = carry
    logits_btw, ids_w = block(start, size)
    new_max = jnp.maximum(max_bt, jnp.max(logits_btw, axis=-1))
    rescale = jnp.exp(max_bt - new_max)  # 0 at the first block (max -inf)
    exp_btw = jnp.exp(logits_btw - new_max[..., None])
    hit_btw = ids_w == targets_bt[..., None]
    return (
      new_max,
      sum_bt * rescale + jnp.sum(exp_btw, axis=-1),
      weighted_bt * rescale + jnp.sum(exp_btw * logits_btw, axis=-1),
      target_bt + jnp.sum(jnp.where(hit_btw, logits_btw, 0.0), axis=-1),
    )

  shape = targets_bt.shape
  zeros = jnp.zeros(shape, jnp.float32)
  carry = (jnp.full(shape, -jnp.inf, jnp.float32), zeros, zeros, zeros)
  starts, tail = _starts(vocab, rows)
  carry, _ = jax.lax.scan(lambda c, start: (add(c, start, rows), None), carry, starts)
  if tail:
    carry = add(carry, *tail)
  max_bt, sum_bt, weighted_bt, target_bt = carry
  logz_bt = max_bt + jnp.log(sum_bt)
  return target_bt - logz_bt, logz_bt - weighted_bt / sum_bt, logz_bt


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _logprobs(h_btd, weights, targets_bt, temperature, vocab_major, vocab_limit, rows):
  logp_bt, entropy_bt, _ = _forward(
    h_btd, weights, targets_bt, temperature,
    vocab_major=vocab_major, vocab_limit=vocab_limit, rows=rows,
  )  # fmt: skip
  return logp_bt, entropy_bt


def _logprobs_fwd(h_btd, weights, targets_bt, temperature, vocab_major, vocab_limit, rows):
  # `symbolic_zeros`: the differentiable arguments come wrapped (value, perturbed).
  h_btd, weights, targets_bt, temperature = (
    x.value for x in (h_btd, weights, targets_bt, temperature)
  )
  logp_bt, entropy_bt, logz_bt = _forward(
    h_btd, weights, targets_bt, temperature,
    vocab_major=vocab_major, vocab_limit=vocab_limit, rows=rows,
  )  # fmt: skip
  residuals = (h_btd, weights, targets_bt, temperature, logz_bt, entropy_bt)
  return (logp_bt, entropy_bt), residuals


def _logprobs_bwd(vocab_major, vocab_limit, rows, residuals, cotangents):
  h_btd, weights, targets_bt, temperature, logz_bt, entropy_bt = residuals
  # The learner's entropies are a metric (stop_gradient): their cotangent is a symbolic zero,
  # and its term is left out rather than computed from zeros.
  d_logp_bt, d_entropy_bt = (
    None if isinstance(x, SymbolicZero) else x.astype(jnp.float32) for x in cotangents
  )
  vocab = weights.shape[0 if vocab_major else 1]
  compute = h_btd.dtype

  def block_grads(start, size):
    """(head gradient of the block's rows, float32; this block's part of the hidden states'
    gradient, float32)."""
    logits_btw, ids_w = _block_logits(
      h_btd, weights, vocab_major, start, size, temperature, vocab_limit
    )
    probs_btw = jnp.exp(logits_btw - logz_bt[..., None])
    hit_btw = ids_w == targets_bt[..., None]
    if vocab_limit:  # a masked logit is a constant: a target past the limit passes nothing
      hit_btw &= ids_w < vocab_limit
    # d logp / d logit_j = [j is the target] - p_j; d entropy / d logit_j = -p_j (log p_j + H).
    d_logits_btw = jnp.zeros_like(logits_btw)
    if d_logp_bt is not None:
      d_logits_btw += d_logp_bt[..., None] * (hit_btw - probs_btw)
    if d_entropy_bt is not None:
      log_p_btw = logits_btw - logz_bt[..., None]
      d_logits_btw -= d_entropy_bt[..., None] * probs_btw * (log_p_btw + entropy_bt[..., None])
    # Masked ids need nothing more: their probability is exactly 0, so both terms are 0
    # (MASKED_LOGIT is finite: 0 times it is 0).
    # Back through "/ temperature" and the cast of the compute-dtype logits to float32.
    d_logits_btw = (d_logits_btw / temperature).astype(compute)
    w_rows = _rows(weights, vocab_major, start, size).astype(compute)
    if vocab_major:
      d_w = jnp.einsum("btd,btw->wd", h_btd, d_logits_btw, preferred_element_type=jnp.float32)
      d_h = jnp.einsum("btw,wd->btd", d_logits_btw, w_rows, preferred_element_type=jnp.float32)
    else:
      d_w = jnp.einsum("btd,btw->dw", h_btd, d_logits_btw, preferred_element_type=jnp.float32)
      d_h = jnp.einsum("btw,dw->btd", d_logits_btw, w_rows, preferred_element_type=jnp.float32)
    return d_w.astype(weights.dtype), d_h

  axis = 0 if vocab_major else 1

  def add(carry, start, size):
    # Each block's rows of the head gradient written in place into the whole: no stack of
    # blocks to concatenate afterwards (a second head-sized buffer).
    d_h_btd, d_weights = carry
    d_w, d_h = block_grads(start, size)
    return d_h_btd + d_h, jax.lax.dynamic_update_slice_in_dim(d_weights, d_w, start, axis)

  starts, tail = _starts(vocab, rows)
  carry = (jnp.zeros(h_btd.shape, jnp.float32), jnp.zeros(weights.shape, weights.dtype))
  carry, _ = jax.lax.scan(lambda c, start: (add(c, start, rows), None), carry, starts)
  if tail:
    carry = add(carry, *tail)
  d_h_btd, d_weights = carry
  return d_h_btd.astype(h_btd.dtype), d_weights, None, None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd, symbolic_zeros=True)


def vocab_block_logprobs(
  hidden_btd: jax.Array,
  head: LMHead,
  targets_bt: jax.Array,
  temperature=1.0,
  *,
  vocab_limit: int = 0,
  rows: int,
) -> tuple[jax.Array, jax.Array]:
  """(float32 log-probs, float32 entropies) `[b, t]` of `targets_bt` under the softmax of the
  head's logits over `hidden_btd` at `temperature`, `rows` vocabulary rows at a time (module
  docstring); differentiable in `hidden_btd` and the head's weights."""
  return _logprobs(
    hidden_btd, head.weights, targets_bt, temperature, head.vocab_major, vocab_limit, rows
  )
