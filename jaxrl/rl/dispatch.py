"""Skew-aware dispatch: predict each prompt's response length and start the longest first.

In a long-tail workload the step waits for its longest responses; starting them first, and
spreading them over workers, lets the short ones fill in around them instead of leaving a few
long ones running alone at the end. The prediction is the prompt's own history (an
exponential moving average of its responses' mean length, seen in earlier epochs), falling back
to the mean over all prompts for a prompt not seen yet.
"""

from __future__ import annotations


class LengthPredictor:
  """Predicted response length (tokens) per prompt id, learned from finished groups."""

  def __init__(self, decay: float = 0.5, default: float = 0.0):
    if not 0.0 <= decay < 1.0:
      raise ValueError(f"decay must be in [0, 1), got {decay}.")
    self.decay = decay
    self.default = default
    self.history: dict[str, float] = {}
    self._total, self._count = 0.0, 0

  def update(self, prompt_id, lengths) -> None:
    """Records the response lengths of one finished group of `prompt_id`."""
    lengths = [float(n) for n in lengths]
    if not lengths:
      return
    mean = sum(lengths) / len(lengths)
    key = str(prompt_id)
    old = self.history.get(key)
    self.history[key] = mean if old is None else self.decay * old + (1 - self.decay) * mean
    self._total += sum(lengths)
    self._count += len(lengths)

  def predict(self, prompt_id) -> float:
    """The prompt's expected response length; the global mean (or `default`) if unseen."""
    known = self.history.get(str(prompt_id))
    if known is not None:
      return known
    return self._total / self._count if self._count else self.default

  def state(self) -> dict:
    """JSON-serialisable state, saved with checkpoints."""
    return {"history": dict(self.history), "total": self._total, "count": self._count}

  def load(self, state: dict) -> None:
    self.history = dict(state.get("history", {}))
    self._total = float(state.get("total", 0.0))
    self._count = int(state.get("count", 0))
