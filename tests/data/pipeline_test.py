"""Tests of PromptLoader: epochs, shuffling, and resuming from a saved state."""

import json

import numpy as np
import pytest

from jaxrl.data import PromptLoader


def _records(n: int, rng: np.random.Generator) -> list[dict]:
  return [
    {"id": f"r{i}", "prompt": f"{int(rng.integers(100))}+1=", "answer": "x"} for i in range(n)
  ]


def _ids(batches) -> list[str]:
  return [r["id"] for batch in batches for r in batch]


@pytest.mark.parametrize("seed", range(4))
def test_state_round_trip(seed):
  rng = np.random.default_rng(seed)
  n, batch_size = int(rng.integers(1, 40)), int(rng.integers(1, 9))
  records = _records(n, rng)
  loader = PromptLoader(records, batch_size=batch_size, seed=seed)
  for _ in range(int(rng.integers(0, 25))):
    next(loader)
  state = json.loads(json.dumps(loader.get_state()))
  expected = [next(loader) for _ in range(15)]
  restored = PromptLoader(records, batch_size=batch_size, seed=seed)
  restored.set_state(state)
  assert [next(restored) for _ in range(15)] == expected
  assert restored.get_state() == loader.get_state()
  # Rewinding the same loader replays the same batches.
  loader.set_state(state)
  assert [next(loader) for _ in range(15)] == expected


@pytest.mark.parametrize(("n", "batch_size"), [(12, 4), (10, 4), (7, 3), (5, 8)])
def test_each_epoch_is_a_permutation(n, batch_size):
  records = _records(n, np.random.default_rng(n))
  loader = PromptLoader(records, batch_size=batch_size, seed=11)
  epochs = 6
  num_batches = -(-epochs * n // batch_size)
  batches = [next(loader) for _ in range(num_batches)]
  assert all(len(b) == batch_size for b in batches)
  stream = _ids(batches)
  per_epoch = [stream[e * n : (e + 1) * n] for e in range(epochs)]
  for order in per_epoch:
    assert sorted(order) == sorted(r["id"] for r in records)
  assert len({tuple(order) for order in per_epoch}) > 1  # reshuffled between epochs
  assert loader.epoch == num_batches * batch_size // n


def test_shuffle_depends_on_seed():
  records = _records(1000, np.random.default_rng(0))
  first = lambda seed: _ids([next(PromptLoader(records, batch_size=100, seed=seed))])
  assert first(3) == first(3)
  assert first(3) != first(4)
  assert first(3) != [r["id"] for r in records[:100]]


def test_no_shuffle_keeps_order():
  records = _records(7, np.random.default_rng(1))
  loader = PromptLoader(records, batch_size=3, seed=0, shuffle=False)
  stream = _ids([next(loader) for _ in range(7)])
  assert stream == [r["id"] for r in records] * 3


def test_yielded_records_are_copies():
  records = _records(4, np.random.default_rng(2))
  loader = PromptLoader(records, batch_size=4, seed=0)
  for r in next(loader):
    r["completion"] = "changed"
  assert all("completion" not in r for r in records)
  assert all("completion" not in r for r in next(loader))


def test_constructor_errors():
  with pytest.raises(ValueError, match="no records"):
    PromptLoader([], batch_size=2, seed=0)
  records = _records(3, np.random.default_rng(3))
  for bad in (0, -2):
    with pytest.raises(ValueError, match="batch_size"):
      PromptLoader(records, batch_size=bad, seed=0)


def test_set_state_rejects_other_loaders_states():
  records = _records(9, np.random.default_rng(4))
  state = PromptLoader(records, batch_size=3, seed=1).get_state()
  for other in [
    PromptLoader(records, batch_size=3, seed=2),
    PromptLoader(records, batch_size=2, seed=1),
    PromptLoader(records[:8], batch_size=3, seed=1),
    PromptLoader(records, batch_size=3, seed=1, shuffle=False),
  ]:
    with pytest.raises(ValueError, match="saved"):
      other.set_state(state)
  loader = PromptLoader(records, batch_size=3, seed=1)
  for bad in [{"next_index": 3}, {**state, "next_batch": -1}, {**state, "version": 99}, [1]]:
    with pytest.raises(ValueError, match="PromptLoader state"):
      loader.set_state(bad)
