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

Tensor parallelism: where the head's vocabulary axis is sharded over `shards` devices, the
head is viewed as `[shards, vocab / shards, d]` (a free reshape that keeps the sharding on
the first axis) and a block is `w` rows at the same offset of every shard: each device
computes its own rows' logits, and only per-position sums cross devices. Blocks of
contiguous rows would make XLA gather the whole head onto every device.

Numbers: a block's logits are the head's, `LMHead.logits` in the hidden states' dtype, then
float32, softcapped (`ModelConfig.final_logit_softcap`, Gemma 2), masked past `vocab_limit`
and divided by the temperature, exactly as the rollout engine computes them; only the order of
the log-sum-exp's sums changes.

Shapes: b batch, t positions, d model width, s shards of the vocabulary, w rows per shard in
a block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxrl.kernels.common import softcap
from jaxrl.model.transformer import MASKED_LOGIT, LMHead

_LANES = 128  # blocks are whole multiples of this many rows (TPU lanes, GPU tiles)


def head_vocab_shards(head: LMHead, mesh: jax.sharding.Mesh) -> int:
  """Devices the LM head's vocabulary axis is sharded over (`head.weights` is its
  `NamedSharding`): the log-probs then take each block's rows from every shard, so that the
  head is never gathered."""
  spec = (*head.weights.spec, None, None)  # a spec may leave trailing dims out
  axes = spec[0 if head.vocab_major else 1]
  if axes is None:
    return 1
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def vocab_block_rows(vocab: int, positions: int, chunk: int) -> int:
  """Rows per vocabulary block: the float32 logits of `positions` x that many rows hold about
  what `chunk` positions x the whole vocabulary did (the memory `chunk` has always bounded),
  rounded up to a multiple of 128 and at most the vocabulary."""
  rows = -(-chunk * vocab // max(positions, 1))
  return min(vocab, max(_LANES, -(-rows // _LANES) * _LANES))


# Einsum specs by head layout, on the head viewed per vocabulary shard (`_per_shard`): the
# logits of a block, and its two gradients (head rows, hidden states).
_SPECS = {
  True: ("btd,swd->btsw", "btd,btsw->swd", "btsw,swd->btd"),  # [shards, rows, d]
  False: ("btd,dsw->btsw", "btd,btsw->dsw", "btsw,dsw->btd"),  # [d, shards, rows]
}


def _per_shard(weights, vocab_major: bool, shards: int):
  """The head as `[shards, vocab / shards, d]` (vocab-major) or `[d, shards, vocab / shards]`:
  a reshape whose shards axis is the vocabulary's mesh sharding, so that a block of rows taken
  at the same offset in every shard stays on its devices (no gather of the head). One shard:
  the head as stored (the reshape's gradient cost XLA:CPU a head-sized copy)."""
  if shards == 1:
    return weights
  if vocab_major:
    v, d = weights.shape
    return weights.reshape(shards, v // shards, d)
  d, v = weights.shape
  return weights.reshape(d, shards, v // shards)


def _geometry(head, vocab_major: bool) -> tuple[int, int, int]:
  """(shards, rows per shard, the axis of rows) of the head as `_per_shard` left it."""
  if head.ndim == 2:
    return 1, head.shape[0 if vocab_major else 1], 0 if vocab_major else 1
  axis = 1 if vocab_major else 2
  return head.shape[axis - 1], head.shape[axis], axis


def _rows(head, vocab_major: bool, start, size: int):
  """Rows `[start, start + size)` of every shard: `[shards, w, d]` or `[d, shards, w]`."""
  _, _, axis = _geometry(head, vocab_major)
  if isinstance(start, int):
    rows = jax.lax.slice_in_dim(head, start, start + size, axis=axis)
  else:
    rows = jax.lax.dynamic_slice_in_dim(head, start, size, axis=axis)
  return rows if head.ndim == 3 else jnp.expand_dims(rows, 0 if vocab_major else 1)


def _block_logits(h_btd, head3, vocab_major, start, size, temperature, vocab_limit, cap=0.0):
  """(float32 logits `[b, t, shards, w]` of rows `[start, start + size)` of every shard, as the
  model computes them (`LMHead.logits`: in the hidden states' dtype, then float32, then the
  softcap `cap`), their vocabulary ids `[shards, w]`)."""
  w_rows = _rows(head3, vocab_major, start, size)
  logits = jnp.einsum(_SPECS[vocab_major][0], h_btd, w_rows.astype(h_btd.dtype))
  logits_btsw = softcap(logits.astype(jnp.float32), cap)
  shards, per_shard, _ = _geometry(head3, vocab_major)
  ids_sw = (
    jnp.arange(shards, dtype=jnp.int32)[:, None] * per_shard
    + start
    + jnp.arange(size, dtype=jnp.int32)[None, :]
  )
  if vocab_limit:
    logits_btsw = jnp.where(ids_sw < vocab_limit, logits_btsw, MASKED_LOGIT)
  return logits_btsw / temperature, ids_sw


def _starts(vocab: int, rows: int):
  """(int32 starts of the whole blocks, for a loop; the start and size of the last, partial
  block, or None)."""
  whole, tail = divmod(vocab, rows)
  starts = jnp.arange(whole, dtype=jnp.int32) * rows
  return starts, ((whole * rows, tail) if tail else None)


_BLOCK_AXES = (-2, -1)  # a block's logits `[b, t, shards, w]`: its vocabulary axes


def _forward(h_btd, head3, targets_bt, temperature, *, vocab_major, vocab_limit, rows, cap):
  """(log-probs, entropies, log-sum-exp), float32 `[b, t]`."""
  block = functools.partial(
    _block_logits, h_btd, head3, vocab_major, temperature=temperature, vocab_limit=vocab_limit,
    cap=cap,
  )  # fmt: skip
  hit = targets_bt[..., None, None]

  def add(carry, start, size):
    max_bt, sum_bt, weighted_bt, target_bt = carry
    logits, ids_sw = block(start, size)
    new_max = jnp.maximum(max_bt, jnp.max(logits, axis=_BLOCK_AXES))
    rescale = jnp.exp(max_bt - new_max)  # 0 at the first block (max -inf)
    exps = jnp.exp(logits - new_max[..., None, None])
    return (
      new_max,
      sum_bt * rescale + jnp.sum(exps, axis=_BLOCK_AXES),
      weighted_bt * rescale + jnp.sum(exps * logits, axis=_BLOCK_AXES),
      target_bt + jnp.sum(jnp.where(ids_sw == hit, logits, 0.0), axis=_BLOCK_AXES),
    )

  shape = targets_bt.shape
  zeros = jnp.zeros(shape, jnp.float32)
  carry = (jnp.full(shape, -jnp.inf, jnp.float32), zeros, zeros, zeros)
  starts, tail = _starts(_geometry(head3, vocab_major)[1], rows)
  carry, _ = jax.lax.scan(lambda c, start: (add(c, start, rows), None), carry, starts)
  if tail:
    carry = add(carry, *tail)
  max_bt, sum_bt, weighted_bt, target_bt = carry
  logz_bt = max_bt + jnp.log(sum_bt)
  return target_bt - logz_bt, logz_bt - weighted_bt / sum_bt, logz_bt


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _logprobs(h_btd, head3, targets_bt, temperature, vocab_major, vocab_limit, rows, cap):
  logp_bt, entropy_bt, _ = _forward(
    h_btd, head3, targets_bt, temperature,
    vocab_major=vocab_major, vocab_limit=vocab_limit, rows=rows, cap=cap,
  )  # fmt: skip
  return logp_bt, entropy_bt


def _logprobs_fwd(h_btd, head3, targets_bt, temperature, vocab_major, vocab_limit, rows, cap):
  # `symbolic_zeros`: the differentiable arguments come wrapped (value, perturbed).
  h_btd, head3, targets_bt, temperature = (x.value for x in (h_btd, head3, targets_bt, temperature))
  logp_bt, entropy_bt, logz_bt = _forward(
    h_btd, head3, targets_bt, temperature,
    vocab_major=vocab_major, vocab_limit=vocab_limit, rows=rows, cap=cap,
  )  # fmt: skip
  residuals = (h_btd, head3, targets_bt, temperature, logz_bt, entropy_bt)
  return (logp_bt, entropy_bt), residuals


def _logprobs_bwd(vocab_major, vocab_limit, rows, cap, residuals, cotangents):
  h_btd, head3, targets_bt, temperature, logz_bt, entropy_bt = residuals
  # The learner's entropies are a metric (stop_gradient): their cotangent is a symbolic zero,
  # and its term is left out rather than computed from zeros.
  d_logp_bt, d_entropy_bt = (
    None if isinstance(x, SymbolicZero) else x.astype(jnp.float32)[..., None, None]
    for x in cotangents
  )
  # Per-position values against a block's `[b, t, shards, w]` logits.
  logz, entropy, hit = (x[..., None, None] for x in (logz_bt, entropy_bt, targets_bt))
  compute = h_btd.dtype
  _, head_spec, hidden_spec = _SPECS[vocab_major]
  _, per_shard, axis = _geometry(head3, vocab_major)

  def block_grads(start, size):
    """(head gradient of the block's rows, float32 -> the head's dtype; this block's part of
    the hidden states' gradient, float32)."""
    logits, ids_sw = _block_logits(
      h_btd, head3, vocab_major, start, size, temperature, vocab_limit, cap
    )
    probs = jnp.exp(logits - logz)
    hits = ids_sw == hit
    if vocab_limit:  # a masked logit is a constant: a target past the limit passes nothing
      hits &= ids_sw < vocab_limit
    # d logp / d logit_j = [j is the target] - p_j; d entropy / d logit_j = -p_j (log p_j + H).
    # Masked ids need nothing more: their probability is exactly 0, so both terms are 0
    # (MASKED_LOGIT is finite: 0 times it is 0).
    d_logits = jnp.zeros_like(logits)
    if d_logp_bt is not None:
      d_logits += d_logp_bt * (hits - probs)
    if d_entropy_bt is not None:
      d_logits -= d_entropy_bt * probs * (logits - logz + entropy)
    # Back through "/ temperature", the softcap (derivative 1 - (capped / cap)^2; clipped,
    # so that a masked logit, -1e30 where capped ones lie in [-cap, cap], gives 0, not the
    # square's overflow) and the cast of the compute-dtype logits to float32.
    d_logits = d_logits / temperature
    if cap:
      d_logits *= 1.0 - jnp.square(jnp.clip(logits * temperature / cap, -1.0, 1.0))
    d_logits = d_logits.astype(compute)
    w_rows = _rows(head3, vocab_major, start, size).astype(compute)
    d_w = jnp.einsum(head_spec, h_btd, d_logits, preferred_element_type=jnp.float32)
    d_h = jnp.einsum(hidden_spec, d_logits, w_rows, preferred_element_type=jnp.float32)
    return d_w.astype(head3.dtype), d_h

  def add(carry, start, size):
    # Each block's rows of the head gradient written in place into the whole: no stack of
    # blocks to concatenate afterwards (a second head-sized buffer).
    d_h_btd, d_head3 = carry
    d_w, d_h = block_grads(start, size)
    if d_head3.ndim == 2:  # one shard, the head as stored
      d_w = jnp.squeeze(d_w, 0 if vocab_major else 1)
    return d_h_btd + d_h, jax.lax.dynamic_update_slice_in_dim(d_head3, d_w, start, axis)

  starts, tail = _starts(per_shard, rows)
  carry = (jnp.zeros(h_btd.shape, jnp.float32), jnp.zeros(head3.shape, head3.dtype))
  carry, _ = jax.lax.scan(lambda c, start: (add(c, start, rows), None), carry, starts)
  if tail:
    carry = add(carry, *tail)
  d_h_btd, d_head3 = carry
  return d_h_btd.astype(h_btd.dtype), d_head3, None, None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd, symbolic_zeros=True)


def vocab_block_logprobs(
  hidden_btd: jax.Array,
  head: LMHead,
  targets_bt: jax.Array,
  temperature=1.0,
  *,
  vocab_limit: int = 0,
  rows: int,
  shards: int = 1,
  logit_softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """(float32 log-probs, float32 entropies) `[b, t]` of `targets_bt` under the softmax of the
  head's logits over `hidden_btd` at `temperature`, `rows` vocabulary rows of each of
  `shards` equal parts of the vocabulary at a time (module docstring); differentiable in
  `hidden_btd` and the head's weights. `shards`: the devices the head's vocabulary axis is
  sharded over, so that every block takes rows from every shard and none is gathered.
  `logit_softcap`: `ModelConfig.final_logit_softcap` (0: none)."""
  vocab = head.weights.shape[0 if head.vocab_major else 1]
  if shards < 1 or vocab % shards:
    raise ValueError(f"shards must be >= 1 and divide the vocabulary ({vocab}), got {shards}.")
  head3 = _per_shard(head.weights, head.vocab_major, shards)
  logp_bt, entropy_bt = _logprobs(
    hidden_btd, head3, targets_bt, temperature, head.vocab_major, vocab_limit, rows,
    float(logit_softcap),
  )  # fmt: skip
  return logp_bt, entropy_bt
