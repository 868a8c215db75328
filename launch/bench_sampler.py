"""`python launch/bench.py sampler`: one decode step's sampling, the engine's sampler against
Gumbel-max, on one device.

Rows of random float32 logits at a vocabulary of `vocab` entries, temperature 1, no top-k or
top-p (`NO_FILTER`): `jaxrl.rollout.sample_tokens` (the inverse CDF over blocks of the
vocabulary, `sampling.draw_from_logits`) against the same token and log-probability by
Gumbel-max (`jax.random.categorical`'s method, the engine's sampler before 2026-11-26: a threefry
random number per logit, fused into the argmax, and a log-sum-exp), in the same run. Each is one
jitted call; time = the best mean of 20 calls over 3 rounds. Both draw exactly from the softmax
(tests/rollout/engine_test.py checks the engine's by a chi-square test), with different random
numbers, so their tokens differ.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout import sample_tokens
from jaxrl.rollout.sampling import NO_FILTER, first_argmax

CASES = ((16, 151936), (64, 151936), (256, 151936), (64, 32768))  # (rows, vocab)


def gumbel_max(keys_b, logits_bv):
  """Tokens and log-probs by Gumbel-max: the baseline."""
  noise_bv = jax.vmap(lambda key: jax.random.gumbel(key, logits_bv.shape[-1:]))(keys_b)
  tokens_b = first_argmax(logits_bv + noise_bv)
  chosen_b = jnp.take_along_axis(logits_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b, chosen_b - jax.nn.logsumexp(logits_bv, axis=-1)


def _best_us(fn, *args, repeats: int = 20, rounds: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(repeats):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / repeats)
  return best * 1e6


def bench_sampler(cases=CASES) -> dict:
  rng = np.random.default_rng(0)
  out = {"device": str(jax.devices()[0].device_kind)}
  for rows, vocab in cases:
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 2, jnp.float32)
    keys = jax.random.split(jax.random.key(0), rows)
    ones, no_k = jnp.ones(rows), jnp.zeros(rows, jnp.int32)
    engine = jax.jit(functools.partial(sample_tokens, filter_width=NO_FILTER))
    engine_us = _best_us(engine, keys, logits, ones, no_k, ones)
    gumbel_us = _best_us(jax.jit(gumbel_max), keys, logits)
    out[f"{rows}x{vocab}"] = {
      "engine_us": engine_us,
      "gumbel_max_us": gumbel_us,
      "speedup": gumbel_us / engine_us,
    }
  return out
