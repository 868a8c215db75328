"""Batch lengths: few shapes for long sequences, and every length pad_sequences can give is one
`batch_lengths` lists (what the learner precompiles)."""

import numpy as np

from jaxrl.rl.experience import batch_length, batch_lengths, pad_sequences


def test_long_batches_meet_few_shapes_with_bounded_padding():
  lengths = {batch_length(n) for n in range(1, 32_769)}
  # 16 multiples of 8 up to 128, then 4 per doubling up to 32k.
  assert len(lengths) == 16 + 4 * 8
  for n in range(1, 32_769, 7):
    padded = batch_length(n)
    assert padded >= n and padded % 8 == 0
    assert padded <= max(n + 7, 1.25 * n), (n, padded)


def test_batch_lengths_cover_every_padded_length():
  rng = np.random.default_rng()
  shortest, longest, max_new = 40, 300, 3000
  lengths = batch_lengths(shortest, longest, max_new)
  assert lengths == sorted(set(lengths)) and lengths[-1] == batch_length(longest + max_new)
  for _ in range(30):
    prompts = [[3] * int(rng.integers(shortest, longest + 1)) for _ in range(2)]
    responses = [[4] * int(rng.integers(1, max_new + 1)) for _ in range(2)]
    assert pad_sequences(prompts, responses, 0)[0].shape[1] in lengths
