"""What each stage of a real run did when: the learner's updates and weight publications, and
each rollout engine's decode windows and weight switches, as wall-clock spans.

Every controller keeps one `StageTimeline`; `job.run` writes it to `timeline.json` and draws
`stage_timeline.png` (the whole run, and a zoom on its last steps). A gap in a lane is time
that stage's devices sat idle. Lanes of the `local` backend's worker threads are recorded; a
Ray worker's decode windows happen in another process and are not.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence

from jaxrl.scheduler.timeline import plot_lanes

LEARNER_LANE = "learner"
# Spans closer than this are drawn as one: a worker's back-to-back decode windows are a few
# hundred microseconds apart, and one bar per window would make a long run's file large.
MERGE_GAP_S = 2e-3

Segment = tuple[str, float, float, str]  # (lane, start s, end s, kind), times from the start


class StageTimeline:
  """Thread-safe recorder of (lane, start, end, kind) spans; kinds are those of
  `jaxrl.scheduler.timeline.KINDS` ("decode", "train", "weight-sync", ...)."""

  def __init__(self):
    self.start = time.time()
    self._lanes: dict[str, list[list]] = {}
    self._lock = threading.Lock()

  def add(self, lane: str, start: float, end: float, kind: str) -> None:
    """Records a span given as `time.time()` values."""
    if end <= start:
      return
    start, end = start - self.start, end - self.start
    with self._lock:
      spans = self._lanes.setdefault(lane, [])
      if spans and spans[-1][2] == kind and 0 <= start - spans[-1][1] < MERGE_GAP_S:
        spans[-1][1] = end
      else:
        spans.append([start, end, kind])

  @contextlib.contextmanager
  def span(self, lane: str, kind: str) -> Iterator[None]:
    start = time.time()
    try:
      yield
    finally:
      self.add(lane, start, time.time(), kind)

  def segments(self) -> list[Segment]:
    with self._lock:
      return [(lane, s, e, k) for lane, spans in self._lanes.items() for s, e, k in spans]

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      json.dump({"segments": self.segments()}, f)


def load_segments(path: str) -> list[Segment]:
  with open(path) as f:
    return [tuple(s) for s in json.load(f)["segments"]]


def last_steps_window(segments: Sequence[Segment], steps: int) -> tuple[float, float] | None:
  """(start, end) of the run's last `steps` steps: from the end of the learner update before
  them (so the rollout that fed the first one shows) to the end of the learner's last span."""
  learner = sorted((s, e, kind) for lane, s, e, kind in segments if lane == LEARNER_LANE)
  train = [(s, e) for s, e, kind in learner if kind == "train"]
  if len(train) < steps + 1:
    return None
  return train[-steps - 1][1], learner[-1][1]


def plot_stage_timeline(segments: Sequence[Segment], path: str, title: str, zoom_steps: int = 4):
  """The whole run, and (when it has more steps) a zoom on its last `zoom_steps` steps."""
  panels = {f"{title}: whole run": (segments, None)}
  window = last_steps_window(segments, zoom_steps)
  if window is not None:
    panels[f"last {zoom_steps} steps"] = (segments, window)
  return plot_lanes(panels, path, lane_order=[LEARNER_LANE])
