"""An endless, checkpointable stream of batches of prompt records, built on grain.

The records are shuffled per epoch (a different permutation each epoch, all from the seed),
epochs are concatenated, and the stream is cut into batches of `batch_size`; a batch may span
two epochs, so no record is dropped or seen twice within an epoch.
"""

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import grain

_STATE_VERSION = 1
_MAX_RECORDS_STREAMED = 2**62


def _grain_seed(seed: int) -> int:
  # grain reshuffles epoch e with seed + e, so seeds 0 and 1 would share permutations shifted
  # by one epoch; hashing the seed decorrelates runs with nearby seeds.
  digest = hashlib.sha256(f"jaxrl.PromptLoader:{seed}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


class PromptLoader:
  """Yields batches (`list[dict]`) of prompt records forever.

  Example:
    loader = PromptLoader(records, batch_size=8, seed=0)
    batch = next(loader)
    state = loader.get_state()  # JSON-serialisable; store it with the checkpoint.
    ...
    loader = PromptLoader(records, batch_size=8, seed=0)
    loader.set_state(state)  # continues with the batch the first loader would yield next.

  Each yielded record is a shallow copy, so a consumer may add fields to it freely.
  """

  def __init__(
    self, records: Sequence[dict[str, Any]], *, batch_size: int, seed: int, shuffle: bool = True
  ):
    """Builds the loader.

    Args:
      records: the prompt records; not copied, so do not change it while the loader is in use.
      batch_size: records per batch.
      seed: selects the permutation of each epoch.
      shuffle: False yields the records in order, epoch after epoch.

    Raises:
      ValueError: no records, or `batch_size` < 1.
    """
    if len(records) == 0:
      raise ValueError(
        "PromptLoader got no records; check the task's split and `num` (or the dataset file)."
      )
    if batch_size < 1:
      raise ValueError(f"PromptLoader batch_size={batch_size}: set it to 1 or more.")
    self._num_records = len(records)
    self._batch_size = batch_size
    self._seed = seed
    self._shuffle = shuffle
    ds = grain.MapDataset.source(records)
    if shuffle:
      ds = ds.shuffle(seed=_grain_seed(seed))
    # Endless in practice; grain's infinite repeat() (length sys.maxsize) overflows `len` once
    # batched with batch_size 1.
    ds = ds.repeat(num_epochs=_MAX_RECORDS_STREAMED // len(records))
    ds = ds.map(dict).batch(batch_size, batch_fn=list)
    # Synchronous reads: records are in memory, and prefetch threads would compete with the
    # training loop for the GIL and read ahead batches that a set_state throws away.
    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    self._iterator = iter(ds.to_iter_dataset(read_options=read_options))

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def num_records(self) -> int:
    return self._num_records

  @property
  def epoch(self) -> int:
    """The epoch the next batch starts in (0-based)."""
    return self._next_index() * self._batch_size // self._num_records

  def _next_index(self) -> int:
    return int(self._iterator.get_state()["next_index"])

  def __iter__(self) -> Iterator[list[dict[str, Any]]]:
    return self

  def __next__(self) -> list[dict[str, Any]]:
    return next(self._iterator)

  def _identity(self) -> dict[str, Any]:
    return {
      "num_records": self._num_records,
      "batch_size": self._batch_size,
      "seed": self._seed,
      "shuffle": self._shuffle,
    }

  def get_state(self) -> dict[str, Any]:
    """Returns the position in the stream as a JSON-serialisable dict."""
    return {"version": _STATE_VERSION, "next_batch": self._next_index(), **self._identity()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Moves to the position `state` (from `get_state`) recorded.

    Raises:
      ValueError: `state` is malformed, or was saved by a loader over a different number of
        records, batch size, seed or shuffle setting (it would resume at the wrong place).
    """
    expected = {"version", "next_batch", *self._identity()}
    if not isinstance(state, dict) or set(state) != expected:
      got = sorted(state) if isinstance(state, dict) else type(state).__name__
      raise ValueError(f"PromptLoader state must have keys {sorted(expected)}, got {got}.")
    if state["version"] != _STATE_VERSION:
      raise ValueError(
        f"PromptLoader state version {state['version']} is not the supported {_STATE_VERSION}."
      )
    mismatched = {k: (state[k], v) for k, v in self._identity().items() if state[k] != v}
    if mismatched:
      details = ", ".join(f"{k}: saved {s!r}, now {n!r}" for k, (s, n) in mismatched.items())
      raise ValueError(
        f"PromptLoader state was saved by a different loader ({details}); build the loader "
        "with the saved settings to resume."
      )
    next_batch = state["next_batch"]
    if not isinstance(next_batch, int) or next_batch < 0:
      raise ValueError(f"PromptLoader state next_batch={next_batch!r}: expected an int >= 0.")
    self._iterator.set_state({"next_index": next_batch})
