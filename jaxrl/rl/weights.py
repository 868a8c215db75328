"""Versioned weight store between the learner and the rollout side.

The learner publishes (version, params) as one unit; readers get the newest complete pair, never
parameters of one version labelled with another. Re-sharding to a reader's layout is the
reader's job (`RolloutEngine.update_weights` places weights on its own mesh).
"""

from __future__ import annotations

import threading

from jaxrl.model import Params


class WeightStore:
  """Holds the newest published weights and their version."""

  def __init__(self):
    self._lock = threading.Lock()
    self._latest: tuple[int, Params] | None = None

  def publish(self, params: Params, version: int) -> None:
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

  @property
  def version(self) -> int:
    with self._lock:
      return -1 if self._latest is None else self._latest[0]
