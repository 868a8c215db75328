"""Random RL batches for learner tests: ragged prompts and responses padded to one length."""

import numpy as np

from jaxrl.rl.experience import pad_sequences
from jaxrl.train import TrainBatch


def random_batch(rng, size: int = 16, length: int = 24) -> TrainBatch:
  """`size` sequences of a 2-7 token prompt and a 1-8 token response (ids 3..59), padded to
  `length`, with behaviour log-probs about -3 on the response and normal advantages."""
  prompts = [list(rng.integers(3, 60, rng.integers(2, 8))) for _ in range(size)]
  responses = [list(rng.integers(3, 60, rng.integers(1, 9))) for _ in range(size)]
  tokens, mask = pad_sequences(prompts, responses, 0, length=length)
  old = np.where(mask > 0, rng.normal(-3.0, 0.3, mask.shape), 0.0).astype(np.float32)
  return TrainBatch(tokens, mask, old, rng.normal(size=size).astype(np.float32))
