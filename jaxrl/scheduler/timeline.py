"""Timelines: the lane recorder the simulator fills, plots of its results
(`simulator.SimResult`): lane timelines and a policy comparison, and `plot_lanes`, which also
draws the stage timelines of real runs (`jaxrl.rl.timeline`).

Figures are drawn on matplotlib's Agg canvas directly (imported on first plot), so this module
never changes the process's pyplot backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jaxrl.scheduler.simulator import SimResult

# Drawn in this order, so a "compile" span shows on top of the stage span it stalled.
KINDS = ("decode", "prefill", "idle-wait", "weight-sync", "train", "compile")
TRAIN_LANE = "train"
COLORS = {
  "decode": "#3182bd",
  "prefill": "#fd8d3c",
  "idle-wait": "#d9d9d9",
  "weight-sync": "#de2d26",
  "train": "#31a354",
  "compile": "#252525",
}


class Recorder:
  """Segments per lane; a segment continuing the lane's last one of the same kind extends it."""

  def __init__(self):
    self.lanes: dict[str, list[list]] = {TRAIN_LANE: []}

  def lane(self, name: str) -> str:
    self.lanes[name] = []
    return name

  def add(self, lane: str | None, start: float, end: float, kind: str) -> None:
    if lane is None or end <= start:
      return
    segs = self.lanes[lane]
    if segs and segs[-1][2] == kind and abs(segs[-1][1] - start) < 1e-9:
      segs[-1][1] = end
    else:
      segs.append([start, end, kind])

  def segments(
    self, training: Sequence[tuple[float, float]] = ()
  ) -> tuple[tuple[str, float, float, str], ...]:
    """(lane, start, end, kind) of every lane; with `training` intervals, rollout lanes'
    waits inside them become "train" (colocated devices train in the rollout's pauses)."""
    out = []
    for lane, segs in self.lanes.items():
      for start, end, kind in segs:
        if lane == TRAIN_LANE or kind != "idle-wait" or not training:
          out.append((lane, start, end, kind))
          continue
        t = start
        for s, e in training:
          s, e = max(s, start), min(e, end)
          if e > s:
            out += [(lane, t, s, "idle-wait")] if s > t else []
            out.append((lane, s, e, "train"))
            t = e
        out += [(lane, t, end, "idle-wait")] if end > t else []
    return tuple(out)


def plot_timeline(result: SimResult, path: str) -> str:
  """Draws `result.timeline` (one row per sampled lane, coloured by kind) to `path` (PNG)."""
  lanes = [TRAIN_LANE] + sorted(
    {lane for lane, *_ in result.timeline} - {TRAIN_LANE},
    key=lambda lane: int(lane.rsplit("#", 1)[-1]),  # instance id: creation order
  )
  title = (
    f"{result.policy}: {result.samples_per_s:.3g} samples/s, "
    f"${result.cost_per_1k_samples:.3g} per 1k samples, {result.steps} steps"
    + (f", {result.preemptions} preemptions" if result.preemptions else "")
  )
  window = (0.0, max(result.wall_seconds, 1e-9))
  return plot_lanes({title: (result.timeline, window)}, path, lane_order=lanes)


def plot_lanes(
  panels: dict[str, tuple[Sequence[tuple[str, float, float, str]], tuple[float, float] | None]],
  path: str,
  lane_order: Sequence[str] = (),
) -> str:
  """One panel per title: its (lane, start, end, kind) segments as coloured bars, one row per
  lane, over its (start, end) window (None: the whole span). Lanes in `lane_order` come first,
  the others in the order they first appear. Writes a PNG to `path`."""
  from matplotlib.patches import Patch

  def lanes_of(segments) -> list[str]:
    rows = list(dict.fromkeys(lane for lane, *_ in segments))
    return [lane for lane in lane_order if lane in rows] + [r for r in rows if r not in lane_order]

  heights = [1.0 + 0.22 * len(lanes_of(segments)) for segments, _ in panels.values()]
  fig = _figure(12, 0.8 + sum(heights))
  grid = fig.add_gridspec(len(panels), 1, height_ratios=heights)
  for i, (title, (segments, window)) in enumerate(panels.items()):
    lanes = lanes_of(segments)
    ax = fig.add_subplot(grid[i])
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for lane, start, end, kind in segments:
      bars.setdefault((lane, kind), []).append((start, end - start))
    for row, lane in enumerate(lanes):
      for kind in KINDS:
        if (lane, kind) in bars:
          ax.broken_barh(bars[lane, kind], (row - 0.4, 0.8), facecolors=COLORS[kind], linewidth=0)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if window is None:
      window = (0.0, max((e for _, _, e, _ in segments), default=1.0))
    ax.set_xlim(*window)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=10)
  used = [k for k in KINDS if any(kind == k for segs, _ in panels.values() for *_, kind in segs)]
  fig.legend(
    handles=[Patch(color=COLORS[k], label=k) for k in used],
    loc="lower center",
    ncol=max(1, len(used)),
    fontsize=8,
    frameon=False,
  )
  fig.tight_layout(rect=(0, 0.05, 1, 1))
  _makedirs(path)
  fig.savefig(path, dpi=110)
  return path


def plot_comparison(results: Sequence[SimResult], path: str) -> str:
  """Bar charts of simulated samples/s and $ per 1k samples per policy (dots: the cost
  model's prediction for the same plan) to `path` (PNG)."""
  names = [r.policy for r in results]
  xs = range(len(results))
  fig = _figure(max(6, 2.2 * len(results)), 4.2)
  panels = (
    ("samples / s", [r.samples_per_s for r in results], [r.plan_samples_per_s for r in results]),
    (
      "$ per 1k samples",
      [r.cost_per_1k_samples for r in results],
      [r.plan_cost_per_1k_samples for r in results],
    ),
  )
  for i, (label, values, predicted) in enumerate(panels):
    ax = fig.add_subplot(1, 2, i + 1)
    ax.bar(xs, values, color="#3182bd", label="simulated")
    ax.plot(xs, predicted, "o", color="black", label="cost model")
    for x, v in zip(xs, values, strict=True):
      ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
  fig.tight_layout()
  _makedirs(path)
  fig.savefig(path, dpi=110)
  return path


def _figure(width: float, height: float):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  return fig


def _makedirs(path: str) -> None:
  folder = os.path.dirname(path)
  if folder:
    os.makedirs(folder, exist_ok=True)
