"""`python launch/bench.py logprobs [--json]`: the learner's log-probs through the LM head,
forward and backward, a block of vocabulary rows at a time (`jaxrl.train.vocab_blocks`, what
`chunked_token_logprobs` runs) against chunks of positions (what it ran before, kept here as
the baseline).

Qwen3-0.6B's head (151,936 x 1,024, tied: vocabulary-major) over one row of L positions at
`chunk` = 128 (`train.logprob_chunk`'s default): the time of the gradient of sum(log-probs *
weights) in the hidden states and the head, the mean entropy beside it as a metric (as the
learner does; best of a few calls after one that compiles), XLA's
temporaries for it, and the largest difference of each result from the baseline's. bf16
hidden states on a float32 head (the learner's master weights) on an accelerator; float32 on
CPU (XLA:CPU has no fast bf16 matmuls) at shorter rows.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model import LMHead
from jaxrl.model.transformer import vocab_mask
from jaxrl.train.losses import chunked_token_logprobs

VOCAB, D_MODEL = 151936, 1024


def position_chunks(hidden_btd, head, targets_bt, temperature=1.0, *, vocab_limit=0, chunk=128):
  """The baseline: the head over `chunk` positions at a time (the whole vocabulary each), the
  loop's backward recomputing each chunk's logits and adding its head gradient into a sum."""
  b, t, d = hidden_btd.shape
  pad = -t % chunk
  n = (t + pad) // chunk
  hidden_nbcd = jnp.swapaxes(
    jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d), 0, 1
  )
  targets_nbc = jnp.swapaxes(jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk), 0, 1)

  def chunk_stats(hidden_bcd, targets_bc):
    logits_bcv = vocab_mask(head.logits(hidden_bcd).astype(jnp.float32), vocab_limit)
    logits_bcv = logits_bcv / temperature
    logz_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
    target_bc = jnp.take_along_axis(logits_bcv, targets_bc[..., None], axis=-1)[..., 0]
    probs_bcv = jnp.exp(logits_bcv - logz_bc[..., None])
    entropy_bc = logz_bc - jnp.sum(probs_bcv * logits_bcv, axis=-1)
    return target_bc - logz_bc, entropy_bc

  stats_nbc = jax.lax.map(lambda xs: jax.checkpoint(chunk_stats)(*xs), (hidden_nbcd, targets_nbc))
  return tuple(jnp.swapaxes(x, 0, 1).reshape(b, n * chunk)[:, :t] for x in stats_nbc)


def bench_logprobs(lengths=None, chunk: int = 128, repeats: int = 3) -> dict:
  """Each length's rows: `vocab_blocks` and `position_chunks` (module docstring)."""
  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  lengths = lengths or ((1024, 2048) if on_cpu else (4096, 16384))
  dtype = jnp.float32 if on_cpu else jnp.bfloat16
  rng = np.random.default_rng(0)
  head_vd = jnp.asarray(rng.normal(size=(VOCAB, D_MODEL)) * 0.02, jnp.float32)
  out = {
    "machine": {
      "platform": device.platform,
      "kind": device.device_kind,
      "dtype": jnp.dtype(dtype).name,
      "jax": jax.__version__,
    }
  }
  for length in lengths:
    hidden = jnp.asarray(rng.normal(size=(1, length, D_MODEL)), dtype)
    targets = jnp.asarray(rng.integers(0, VOCAB, (1, length)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(1, length)), jnp.float32)
    results = {}
    for name, stats in (
      ("vocab_blocks", lambda h, head, y: chunked_token_logprobs(h, head, y, chunk=chunk)),
      ("position_chunks", lambda h, head, y: position_chunks(h, head, y, chunk=chunk)),
    ):

      def loss(h, w, y, weights, stats=stats):
        # As the learner: log-probs in the loss, the entropy a metric without a gradient.
        logp, entropy = stats(h, LMHead(w, vocab_major=True), y)
        return jnp.sum(logp * weights), jnp.mean(jax.lax.stop_gradient(entropy))

      args = (hidden, head_vd, targets, weights)
      step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
      compiled = jax.jit(step).lower(*args).compile()
      jax.block_until_ready(compiled(*args))
      best = float("inf")
      for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
      results[name] = result
      out[f"L{length} {name}"] = {
        "ms": best * 1e3,
        "temp_MiB": compiled.memory_analysis().temp_size_in_bytes / 2**20,
      }
    ((value, entropy), grads) = results["vocab_blocks"]
    ((base_value, base_entropy), base_grads) = results["position_chunks"]
    row = out[f"L{length} vocab_blocks"]
    row["speedup"] = out[f"L{length} position_chunks"]["ms"] / row["ms"]
    row["loss_diff"] = float(jnp.abs(value - base_value))
    row["entropy_diff"] = float(jnp.abs(entropy - base_entropy))
    for name, g, w in zip(("hidden", "head"), grads, base_grads, strict=True):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      row[f"{name}_grad_max_rel_diff"] = float(np.abs(g - w).max() / (np.abs(w).max() + 1e-30))
  return out
