"""What each stage of a real run did when: the learner's updates and weight publications, and
each rollout engine's decode windows and weight switches, as wall-clock spans; and the JAX
compilations that stalled them ("compile" spans, on the lane of the stage that compiled).

Every controller keeps one `StageTimeline`; `job.run` writes it to `timeline.json` and draws
`stage_timeline.png` (the whole run, and a zoom on its last steps). A gap in a lane is time
that stage's devices sat idle. Stages in other processes (the `ray` backend's actors) record
into a `ForwardingTimeline` there and send its spans to the controller's.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Iterator, Sequence

import jax

from jaxrl.compile_ahead import COMPILE_AHEAD_THREADS
from jaxrl.scheduler.timeline import plot_lanes

LEARNER_LANE = "learner"
# Spans closer than this are drawn as one: a worker's back-to-back decode windows are a few
# hundred microseconds apart, and one bar per window would make a long run's file large.
MERGE_GAP_S = 2e-3

Segment = tuple[str, float, float, str]  # (lane, start s, end s, kind), times from the start

# JAX reports tracing, lowering and compiling a function as durations when each ends; together
# they are the stall a first call of a new shape costs.
COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
_RECORDING: weakref.WeakSet = weakref.WeakSet()  # timelines that record compilations
_listener_lock = threading.Lock()
_listener_registered = False


def _on_jax_event(event: str, duration_s: float, **_) -> None:
  if event in COMPILE_EVENTS:
    end = time.time()
    for timeline in list(_RECORDING):
      timeline._add_compile(end - duration_s, end)


def _register_compile_listener() -> None:
  # jax.monitoring cannot unregister a listener: one for the process, fanned out to timelines.
  global _listener_registered
  with _listener_lock:
    if not _listener_registered:
      jax.monitoring.register_event_duration_secs_listener(_on_jax_event)
      _listener_registered = True


class StageTimeline:
  """Thread-safe recorder of (lane, start, end, kind) spans; kinds are those of
  `jaxrl.scheduler.timeline.KINDS` ("decode", "train", "weight-sync", ...)."""

  def __init__(self, record_compiles: bool = True, compile_lane: str | None = None):
    """`compile_lane`: where compilations outside any span or bound thread go (by default
    nowhere: they stalled no recorded stage)."""
    self.start = time.time()
    self.compile_lane = compile_lane
    self._lanes: dict[str, list[list]] = {}
    self._lock = threading.Lock()
    self._open = threading.local()  # per thread: the lanes of its open `span`s
    self._thread_lanes: dict[str, str] = {}  # thread name -> lane (threads that `add` spans)
    if record_compiles:
      _register_compile_listener()
      _RECORDING.add(self)

  def bind_thread(self, thread_name: str, lane: str) -> None:
    """Compilations on that thread (outside any `span`) go to `lane`: for threads that record
    their spans after the fact with `add`, as rollout workers do."""
    self._thread_lanes[thread_name] = lane

  def _add_compile(self, start: float, end: float) -> None:
    if threading.current_thread().name.startswith(COMPILE_AHEAD_THREADS):
      return  # compiled ahead, beside the stages (`Learner.compile_ahead`): it stalled none
    stack = getattr(self._open, "lanes", None)
    lane = stack[-1] if stack else self._thread_lanes.get(threading.current_thread().name)
    lane = lane or self.compile_lane
    if lane is not None:  # a compilation outside every recorded stage is no stage's stall
      self.add(lane, start, end, "compile")

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
    stack = self._open.__dict__.setdefault("lanes", [])
    stack.append(lane)
    try:
      yield
    finally:
      stack.pop()
      self.add(lane, start, time.time(), kind)

  def segments(self) -> list[Segment]:
    with self._lock:
      return [(lane, s, e, k) for lane, spans in self._lanes.items() for s, e, k in spans]

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      json.dump({"segments": self.segments()}, f)


class ForwardingTimeline(StageTimeline):
  """The recorder of a stage in another process (a Ray actor): keeps what it records, with
  absolute times, until `drain` hands it to the controller's timeline (`StageTimeline.add`)."""

  def __init__(self, compile_lane: str | None = None):
    super().__init__(compile_lane=compile_lane)
    self._new: list[tuple[str, float, float, str]] = []

  def add(self, lane: str, start: float, end: float, kind: str) -> None:
    if end > start:
      with self._lock:
        self._new.append((lane, start, end, kind))

  def drain(self) -> list[tuple[str, float, float, str]]:
    with self._lock:
      out, self._new = self._new, []
    return out


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


def compile_stalled_steps(segments: Sequence[Segment]) -> list[bool]:
  """Per learner update, in order: whether any lane compiled during that step (from the end of
  the update before to the end of this one). A run's steps without a compilation show its
  steady state; a long run meets each shape once, a short benchmark often."""
  train = sorted(
    (s, e) for lane, s, e, kind in segments if lane == LEARNER_LANE and kind == "train"
  )
  compiles = [(s, e) for _, s, e, kind in segments if kind == "compile"]
  out, step_start = [], 0.0
  for _, end in train:
    out.append(any(s < end and e > step_start for s, e in compiles))
    step_start = end
  return out


def plot_stage_timeline(segments: Sequence[Segment], path: str, title: str, zoom_steps: int = 4):
  """The whole run, and (when it has more steps) a zoom on its last `zoom_steps` steps."""
  panels = {f"{title}: whole run": (segments, None)}
  window = last_steps_window(segments, zoom_steps)
  if window is not None:
    panels[f"last {zoom_steps} steps"] = (segments, window)
  return plot_lanes(panels, path, lane_order=[LEARNER_LANE])
