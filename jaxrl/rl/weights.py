"""Versioned weight store between the learner and the rollout side.

The learner publishes (version, params) as one unit; readers get the newest complete pair, never
parameters of one version labelled with another. Readers pull: a rollout worker asks for
anything newer than what it holds when it is between decode windows, and a new or returning
worker provisions itself the same way. Re-sharding to a reader's layout is the reader's job
(`RolloutEngine.update_weights` places weights on its own mesh).
"""

from __future__ import annotations

import threading

from jaxrl.model import Params


class StoreUnreachable(ConnectionError):
  """A reader could not reach the weight store (a remote store's network, or a test fault)."""


class WeightStore:
  """Holds the newest published weights and their version."""

  def __init__(self):
    self._lock = threading.Lock()
    self._latest: tuple[int, Params] | None = None

  def publish(self, params: Params, version: int) -> None:
    """Makes `params` the newest version. The store keeps a reference, not a copy: publish
    arrays the caller will not donate or mutate (e.g. a host copy)."""
    with self._lock:
      if self._latest is not None and version <= self._latest[0]:
        raise ValueError(
          f"Version {version} published after version {self._latest[0]}; versions must increase."
        )
      self._latest = (version, params)

  def latest(self) -> tuple[int, Params]:
    """The newest (version, params); raises if nothing was published yet."""
    with self._lock:
      if self._latest is None:
        raise RuntimeError("No weights have been published to the store yet.")
      return self._latest

  def pull(self, have: int) -> tuple[int, Params] | None:
    """The newest (version, params) if it is newer than version `have`, else None.

    Raises:
      StoreUnreachable: the store cannot be reached (never for this in-process store).
    """
    with self._lock:
      if self._latest is None or self._latest[0] <= have:
        return None
      return self._latest

  @property
  def version(self) -> int:
    with self._lock:
      return -1 if self._latest is None else self._latest[0]
