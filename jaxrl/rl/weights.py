"""Versioned weight store between the learner and the rollout side.

The learner publishes (version, params) as one unit; readers get the newest complete pair, never
parameters of one version labelled with another. Readers pull: a rollout worker asks for
anything newer than what it holds when it is between decode windows, and a new or returning
worker provisions itself the same way. Re-sharding to a reader's layout is the reader's job
(`RolloutEngine.update_weights` places weights on its own mesh).

Ownership: published weights are read-only. Readers may alias them (an engine whose layout
matches keeps the same buffers) and never donate them. A publisher hands the store arrays it
will not donate or mutate -- a copy, for readers that pull while the learner trains
(`Learner.publish_to`: cast to the readers' dtype on the training devices, and kept there when
the readers are threads of the learner's process, `config.loop.publish_on_device`, else
brought to the host) -- or lends its live buffers and recalls them before it
donates them: the synchronous loop, whose only reader takes the weights before the next
update, publishes without a copy (`publish_to(..., lend=True)`), and the learner's next update
calls `recall`, after which the store holds no buffers of that version: a late pull gets
nothing (the reader keeps its weights and takes the next version; in the sync loop an idle
worker is the only late reader, and it needs the next version before it decodes again), and
`latest` fails with a message instead of reading deleted arrays.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.model import Params
from jaxrl.sharding import readable_from_threads


class StoreUnreachable(ConnectionError):
  """A reader could not reach the weight store (a remote store's network, or a test fault)."""


class WeightStore:
  """Holds the newest published weights and their version."""

  def __init__(self):
    self._lock = threading.Lock()
    self._latest: tuple[int, Params] | None = None
    self._recalled = False  # the latest version's buffers went back to their owner
    self._parts: dict[int, dict] = {}  # version -> part -> shards, while incomplete

  def publish(self, params: Params, version: int) -> None:
    """Makes `params` the newest version. The store keeps a reference, not a copy (see the
    ownership rule above). Readers are threads that may read the arrays at once (two workers
    pulling the same version), so they are readied for that here, on the publisher's thread."""
    readable_from_threads(params)
    with self._lock:
      if self._latest is not None and version <= self._latest[0]:
        raise ValueError(
          f"Version {version} published after version {self._latest[0]}; versions must increase."
        )
      self._latest = (version, params)
      self._recalled = False

  def publish_part(self, version: int, part: int, num_parts: int, shards) -> None:
    """Part `part` of `num_parts` of `version`: the shards one process of a learner gang owns
    (`owned_shards`). The version is assembled and published when its last part arrives;
    until then readers see the previous one (never a torn version)."""
    with self._lock:
      parts = self._parts.setdefault(version, {})
      if part in parts or not 0 <= part < num_parts:
        raise ValueError(
          f"Part {part} of {num_parts} of version {version} sent twice or out of range."
        )
      parts[part] = shards
      if len(parts) < num_parts:
        return
      for v in [v for v in self._parts if v <= version]:
        del self._parts[v]  # this one, and older ones superseded before they were complete
    self.publish(assemble_shards([parts[i] for i in range(num_parts)]), version)

  def recall(self, version: int) -> None:
    """The publisher takes back the buffers it lent as `version` (it is about to donate
    them): the store drops its reference and keeps only the version number."""
    with self._lock:
      if self._latest is not None and self._latest[0] == version:
        self._latest = (version, None)
        self._recalled = True

  def latest(self) -> tuple[int, Params]:
    """The newest (version, params); raises if nothing was published yet, or if its buffers
    were recalled."""
    with self._lock:
      if self._latest is None:
        raise RuntimeError("No weights have been published to the store yet.")
      self._check_not_recalled()
      return self._latest

  def _check_not_recalled(self) -> None:
    if self._recalled:
      raise RuntimeError(
        f"Version {self._latest[0]} was lent to the store and recalled by the learner before "
        "it updated (its buffers are donated); a reader must take lent weights before the next "
        "update, or the learner publish a copy (`publish_to(store, version)`)."
      )

  def pull(self, have: int) -> tuple[int, Params] | None:
    """The newest (version, params) if it is newer than version `have`, else None (also while
    the newest version's buffers are recalled: there is nothing to read until the next one).

    Raises:
      StoreUnreachable: the store cannot be reached (never for this in-process store).
    """
    with self._lock:
      if self._latest is None or self._latest[0] <= have or self._recalled:
        return None
      return self._latest

  def wait_for(self, version: int) -> None:
    """Returns once the store holds `version` or newer: at once here, where `publish` returns
    only when it does (a store in another process may be behind its publisher)."""
    if self.version < version:
      raise RuntimeError(
        f"The store holds version {self.version}, not {version}: nothing publishes it in the "
        "background here; publish it first."
      )

  @property
  def version(self) -> int:
    with self._lock:
      return -1 if self._latest is None else self._latest[0]


@dataclasses.dataclass(frozen=True)
class LeafShards:
  """The pieces of one parameter a process owns: (index into the global array, values)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  pieces: list[tuple[tuple[slice, ...], np.ndarray]]


def owned_shards(params: Params):
  """The shards of `params` this process owns, as host arrays: of each piece of an array one
  replica (`replica_id` 0) is owned, so the processes of a JAX world together own every
  element once, and none sends (or gathers) more than its share."""
  return jax.tree.map(
    lambda x: LeafShards(
      tuple(x.shape),
      x.dtype,
      [(s.index, _as_bits(np.asarray(s.data))) for s in x.addressable_shards if s.replica_id == 0],
    ),
    params,
  )


def assemble_shards(parts: Sequence) -> Params:
  """Whole host arrays from every process's `owned_shards` (one tree each); raises if the
  parts do not cover every element exactly once."""

  def leaf(*shards: LeafShards) -> np.ndarray:
    pieces = [values for s in shards for _, values in s.pieces]
    if len(pieces) == 1 and pieces[0].shape == shards[0].shape:
      return pieces[0].view(shards[0].dtype)  # held whole by one process: no second copy
    out = np.empty(shards[0].shape, shards[0].dtype)
    covered = 0
    for s in shards:
      for index, values in s.pieces:
        out[index] = values.view(out.dtype)
        covered += values.size
    if covered != out.size:
      raise ValueError(
        f"Shards of a {shards[0].shape} parameter cover {covered} of its {out.size} elements: "
        "a process sent too few or overlapping pieces."
      )
    return out

  return jax.tree.map(leaf, *parts, is_leaf=lambda x: isinstance(x, LeafShards))


# Arrays of a dtype numpy does not know natively (ml_dtypes' bfloat16, float8s: kind "V") cross
# Ray as the unsigned integers of their bits: Ray copies such arrays through pickle, and sends
# integer arrays without a copy (this VM: 100 MB of fp32 0.23 s, the same as 50 MB of bf16 0.18
# s, and as uint16 0.04 s, a put and a get). `owned_shards` sends its pieces so; the store actor
# hands out `to_wire(pulled)` and readers take `from_wire` of it.


@dataclasses.dataclass(frozen=True)
class WireBits:
  """An array's bits as unsigned integers, and its dtype (`to_wire`)."""

  bits: np.ndarray
  dtype: np.dtype


def _as_bits(x: np.ndarray) -> np.ndarray:
  return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "V" else x


def to_wire(tree):
  """`tree` with each host array of a non-native dtype as its `WireBits`."""
  is_array = lambda x: isinstance(x, np.ndarray) and x.dtype.kind == "V"  # noqa: E731
  return jax.tree.map(lambda x: WireBits(_as_bits(x), x.dtype) if is_array(x) else x, tree)


def from_wire(tree):
  """`to_wire`'s inverse: each `WireBits` as the array it carries (a view, no copy)."""
  is_bits = lambda x: isinstance(x, WireBits)  # noqa: E731
  return jax.tree.map(lambda x: x.bits.view(x.dtype) if is_bits(x) else x, tree, is_leaf=is_bits)
