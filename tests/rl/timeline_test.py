"""The stage timeline: spans recorded from several threads, merged when back to back, saved,
and drawn with a zoom on the last steps."""

import threading

import jax
import numpy as np

from jaxrl.compile_ahead import COMPILE_AHEAD_THREADS
from jaxrl.rl.timeline import (
  MERGE_GAP_S,
  StageTimeline,
  compile_stalled_steps,
  last_steps_window,
  load_segments,
  plot_stage_timeline,
)


def test_spans_merge_only_when_back_to_back_and_of_one_kind():
  tl = StageTimeline()
  t0 = tl.start
  tl.add("w", t0 + 1.0, t0 + 2.0, "decode")
  tl.add("w", t0 + 2.0 + MERGE_GAP_S / 2, t0 + 3.0, "decode")  # merged into the first
  tl.add("w", t0 + 3.0, t0 + 3.5, "weight-sync")  # another kind: a new span
  tl.add("w", t0 + 4.0, t0 + 5.0, "decode")  # a gap: a new span
  tl.add("w", t0 + 6.0, t0 + 6.0, "decode")  # empty: dropped
  spans = [(lane, round(s, 6), round(e, 6), k) for lane, s, e, k in tl.segments()]
  assert spans == [
    ("w", 1.0, 3.0, "decode"),
    ("w", 3.0, 3.5, "weight-sync"),
    ("w", 4.0, 5.0, "decode"),
  ]


def test_threads_record_their_own_lanes_and_the_file_round_trips(tmp_path):
  tl = StageTimeline()
  rng = np.random.default_rng()
  counts = rng.integers(20, 60, size=4)

  def work(i):
    t = tl.start + i
    for _ in range(counts[i]):
      tl.add(f"worker {i}", t, t + 0.01, "decode")
      t += 0.01 + 10 * MERGE_GAP_S  # never merged

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  spans = tl.segments()
  for i in range(4):
    assert sum(lane == f"worker {i}" for lane, *_ in spans) == counts[i]
  tl.save(str(tmp_path / "timeline.json"))
  assert load_segments(str(tmp_path / "timeline.json")) == spans


def test_zoom_window_starts_after_the_update_before_the_last_steps(tmp_path):
  tl = StageTimeline()
  t0 = tl.start
  for step in range(6):
    tl.add("rollout", t0 + 2 * step, t0 + 2 * step + 1, "decode")
    tl.add("learner", t0 + 2 * step + 1, t0 + 2 * step + 2, "train")
  spans = tl.segments()
  start, end = last_steps_window(spans, 4)
  assert round(start, 6) == 4.0 and round(end, 6) == 12.0  # from the 2nd update to the last
  assert last_steps_window(spans, 6) is None  # no update before the window
  path = plot_stage_timeline(spans, str(tmp_path / "t.png"), "sync")
  assert (tmp_path / "t.png").stat().st_size > 1000 and path.endswith("t.png")


def test_compilations_land_on_the_lane_of_the_stage_that_ran_them():
  tl = StageTimeline()
  x = np.arange(7.0)
  with tl.span("learner", "train"):
    jax.jit(lambda v: v * 3 + 1)(x)  # a new function: traced, lowered and compiled here
  f = jax.jit(lambda v: v - 2)

  def worker_thread():
    f(x)  # compiles
    f(x)  # cached: no compilation

  t = threading.Thread(target=worker_thread, name="rollout-w9")
  tl.bind_thread("rollout-w9", "worker w9")
  t.start()
  t.join()
  unbound = threading.Thread(target=lambda: jax.jit(lambda v: v / 5)(x), name="elsewhere")
  unbound.start()
  unbound.join()
  spans = tl.segments()
  (train,) = [(s, e) for lane, s, e, k in spans if k == "train"]
  learner_compiles = [(s, e) for lane, s, e, k in spans if lane == "learner" and k == "compile"]
  assert learner_compiles and all(train[0] - 1e-3 <= s < e <= train[1] for s, e in learner_compiles)
  worker = [k for lane, _, _, k in spans if lane == "worker w9"]
  assert worker and set(worker) == {"compile"}
  assert {lane for lane, *_ in spans} == {"learner", "worker w9"}  # the unbound thread: none
  assert not any(k == "compile" for *_, k in StageTimeline(record_compiles=False).segments())


def test_compilations_ahead_of_the_stages_stall_none_of_them():
  """`Learner.compile_ahead`'s threads compile beside the stages: not drawn as a stall, even
  on a timeline that puts every other compilation on a lane (a Ray learner actor's)."""
  tl = StageTimeline(compile_lane="learner")
  x = np.arange(5.0)
  ahead = threading.Thread(
    target=lambda: jax.jit(lambda v: v * 7).lower(x).compile(), name=f"{COMPILE_AHEAD_THREADS}_0"
  )
  ahead.start()
  ahead.join()
  assert tl.segments() == []
  other = threading.Thread(target=lambda: jax.jit(lambda v: v * 9)(x), name="other")
  other.start()
  other.join()
  assert {(lane, kind) for lane, _, _, kind in tl.segments()} == {("learner", "compile")}


def test_compile_stalled_steps_flags_the_steps_a_compilation_overlapped():
  segs = [("learner", 2.0 * i + 1, 2.0 * i + 2, "train") for i in range(5)]  # steps end 2,4,..10
  segs += [("worker w0", 2.5, 3.0, "compile"), ("rollout", 7.9, 8.1, "compile")]
  segs += [("worker w0", 0.0, 10.0, "decode")]
  assert compile_stalled_steps(segs) == [False, True, False, True, True]
  assert compile_stalled_steps(segs[:5]) == [False] * 5
