"""The stage timeline: spans recorded from several threads, merged when back to back, saved,
and drawn with a zoom on the last steps."""

import threading

import numpy as np

from jaxrl.rl.timeline import (
  MERGE_GAP_S,
  StageTimeline,
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
