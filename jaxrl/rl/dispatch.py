"""Skew-aware dispatch: predict each prompt's response length and start the longest first.

In a long-tail workload the step waits for its longest responses; starting them first, and
spreading them over workers, lets the short ones fill in around them instead of leaving a few
long ones running alone at the end. The prediction is the prompt's own history (an
exponential moving average of its responses' mean length, seen in earlier epochs), falling back
to the mean over all prompts for a prompt not seen yet.

Workers differ in speed (device count and type, or a machine shared with other work), so the
work is split by rate, not by request count: `WorkerRates` predicts each worker's decode rate
with the scheduler's cost model when it joins and replaces the prediction by the measured rate
once there is one; the split is re-planned whenever the worker set changes.
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


class WorkerRates:
  """Each rollout worker's speed, for splitting the work between workers.

  A new worker starts from the scheduler's cost-model prediction for its devices (its
  *prior*, decode tokens/s at a full batch). Once a worker has done `min_work` units of work
  (the controller counts decode windows), its measured rate of work replaces the prediction,
  and the ratio of measured to predicted over the measured workers calibrates the priors of the
  workers not measured yet (the cost model's ratios are better than its absolute speeds).
  Busy time is the time a worker held requests, measured between its events. The measurement
  forgets old events by `decay` per event, so that a one-off stall (a compilation, a busy
  machine) stops counting against a worker after a few dozen events.
  """

  def __init__(
    self, min_work: float = 8, default_rate: float = 1.0, decay: float = 0.95, measured=True
  ):
    if not 0.0 < decay <= 1.0:
      raise ValueError(f"decay must be in (0, 1], got {decay}.")
    self.min_work = min_work
    self.default = default_rate
    self.decay = decay
    self.measured = measured  # False: `rate` is the prediction alone
    self.prior: dict[str, float] = {}
    self.seen: dict[str, float] = {}  # work so far, for the min_work gate
    self.work: dict[str, float] = {}  # decayed
    self.busy_s: dict[str, float] = {}  # decayed

  def add(self, name: str, predicted_rate: float | None) -> None:
    if predicted_rate is not None and not predicted_rate > 0:
      raise ValueError(f"worker {name!r}: a predicted rate must be positive, got {predicted_rate}.")
    self.prior[name] = predicted_rate or self.default
    self.seen[name] = self.work[name] = self.busy_s[name] = 0.0

  def remove(self, name: str) -> None:
    for table in (self.prior, self.seen, self.work, self.busy_s):
      table.pop(name, None)

  def observe(self, name: str, work: float, busy_s: float) -> None:
    """`work` done by `name` over `busy_s` seconds in which it held requests."""
    if name in self.prior:
      self.seen[name] += work
      self.work[name] = self.decay * self.work[name] + work
      self.busy_s[name] = self.decay * self.busy_s[name] + busy_s

  def _measured(self, name: str) -> float | None:
    work, busy = self.work.get(name, 0.0), self.busy_s.get(name, 0.0)
    return work / busy if self.seen.get(name, 0.0) >= self.min_work and busy > 0 else None

  def rate(self, name: str) -> float:
    """Measured rate, else the calibrated prediction (a worker never added: the default);
    the prediction alone when the rates are not `measured`."""
    if not self.measured:
      return self.prior.get(name, self.default)
    measured = self._measured(name)
    if measured is not None:
      return measured
    known = [(m, self.prior[n]) for n in self.prior if (m := self._measured(n)) is not None]
    scale = sum(m for m, _ in known) / sum(p for _, p in known) if known else 1.0
    return self.prior.get(name, self.default) * scale

  def shares(self) -> dict[str, float]:
    """The fraction of the rollout work each worker should get: its share of the total rate."""
    rates = {name: self.rate(name) for name in self.prior}
    total = sum(rates.values())
    return {name: r / total for name, r in rates.items()} if total else {}
