"""Two packed rows for model tests: segments of the given lengths in each row, the second
row's last segment padding (segment id -1)."""

import jax.numpy as jnp
import numpy as np


def two_packed_rows(vocab_size: int, lengths: tuple[int, ...], rng: np.random.Generator):
  """(tokens, positions, segment ids), int32 `[2, sum(lengths)]`: positions restart at 0 in
  each segment; the second row marks its last segment as padding."""
  tokens = jnp.asarray(rng.integers(0, vocab_size, (2, sum(lengths))), jnp.int32)
  positions = np.concatenate([np.arange(n) for n in lengths])
  segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
  positions = jnp.asarray(np.stack([positions, positions]), jnp.int32)
  padded = np.where(segments == len(lengths) - 1, -1, segments)
  return tokens, positions, jnp.asarray(np.stack([segments, padded]), jnp.int32)
