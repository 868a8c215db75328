"""`python launch/bench.py async`: the RL loop's modes side by side on a long-tail workload.

The demo config (`configs/grpo_tiny.py`, tiny model on the 8 simulated CPU devices) with digit
sorting of long-tailed lengths (median 4 digits, capped at 18, so responses of 2-19 tokens),
the same warm-up and seed for every mode, and the same number of RL steps (so the same number
of samples). Two workloads (`WORKLOADS`):

- "demo": the demo's batches (128 samples, two PPO updates per step), every stage in this
  process on the 8 simulated devices, which share the machine's cores. Modes: synchronous
  colocated and disaggregated (the sync controller), asynchronous with staleness bound 1, 2
  and 4 (workers finish their running responses before switching weights), and asynchronous
  with bound 2 plus partial rollouts.
- "pinned": the stages on hardware of their own: the `ray` backend with `loop.ray_pin_cores`
  puts the learner's actor on half of the cores and one rollout worker's actor on the other
  half, as on separate accelerators. Smaller steps (32 samples, one update each), so that
  rollout is a larger share of a step. The baseline is the same loop with bound 0 (the
  synchronous loop on the same actors); the others as above. The workers compile every decode
  shape before the run (`rollout.paged.precompile`), through a persistent compilation cache
  shared by the modes' actors, so only the first mode pays for it, before it is timed.

Throughput is taken over the steps after the first `skip` (most compilation), and again over
those of them during which no stage compiled a new shape (`samples_per_s_steady`: a long run's
steady state). The result maps workload -> mode -> figures, plus `samples_per_s` and
`speedup_async_vs_sync` (fastest asynchronous mode over the workload's synchronous
disaggregated baseline, also `..._steady`) per workload; timelines of each mode's last steps
go to docs/images/async_timeline_<workload>.png.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile

import jax
import numpy as np

from jaxrl.config import load_config
from jaxrl.metrics import read_metrics
from jaxrl.rl import job
from jaxrl.rl.timeline import LEARNER_LANE, compile_stalled_steps, last_steps_window
from jaxrl.scheduler.timeline import plot_lanes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ASYNC = {"loop.mode": "async"}
WHOLE = {"loop.partial_rollouts": False}  # workers finish running responses before switching
PARTIAL = {"loop.partial_rollouts": True}
MODES = {
  "sync_colocated": {"loop.mode": "sync", "placement.mode": "colocated"},
  "sync_disaggregated": {"loop.mode": "sync"},
  "async_eta1": ASYNC | WHOLE | {"loop.max_staleness": 1},
  "async_eta2": ASYNC | WHOLE | {"loop.max_staleness": 2},
  "async_eta4": ASYNC | WHOLE | {"loop.max_staleness": 4},
  "async_eta2_partial": ASYNC | PARTIAL | {"loop.max_staleness": 2},
}
PINNED = ASYNC | {
  "loop.backend": "ray",
  "loop.ray_pin_cores": True,
  "loop.rollout_workers": 1,
  "rollout.paged.precompile": True,
}
PINNED_MODES = {
  "pinned_sync": PINNED | WHOLE | {"loop.max_staleness": 0},
  "pinned_eta1": PINNED | WHOLE | {"loop.max_staleness": 1},
  "pinned_eta2": PINNED | WHOLE | {"loop.max_staleness": 2},
  "pinned_eta4": PINNED | WHOLE | {"loop.max_staleness": 4},
  "pinned_eta2_partial": PINNED | PARTIAL | {"loop.max_staleness": 2},
}


@dataclasses.dataclass(frozen=True)
class Workload:
  overrides: dict
  modes: dict[str, dict]
  baseline: str  # the synchronous disaggregated mode the speed-up is taken against
  steps: int
  skip: int


WORKLOADS = {
  "demo": Workload({}, MODES, "sync_disaggregated", steps=40, skip=5),
  "pinned": Workload(
    {
      "rollout.prompts_per_step": 4,
      "train.updates_per_step": 1,
      "train.micro_batch_size": 32,
      "placement.mode": "disaggregated",  # 4 + 4 devices: the planner wants larger batches
    },
    PINNED_MODES,
    "pinned_sync",
    steps=80,
    skip=10,
  ),
}
TIMELINE_STEPS = 3  # steps shown per mode in the timeline plot


def bench_async(
  workloads: tuple[str, ...] = tuple(WORKLOADS),
  modes: tuple[str, ...] | None = None,
  steps: int | None = None,
  plot_dir: str | None = os.path.join(REPO, "docs", "images"),
) -> dict:
  """Per workload: samples/s, idle fractions, off-policy tokens and reward per mode, one run;
  with `plot_dir`, a timeline of each mode's last steps to `async_timeline_<workload>.png`.
  `modes` picks modes by name (default: all of each workload's); `steps` overrides each
  workload's step count."""
  out = {}
  for name in workloads:
    w = WORKLOADS[name]
    if steps is not None:
      w = dataclasses.replace(w, steps=steps, skip=min(w.skip, steps // 2))
    chosen = {m: o for m, o in w.modes.items() if modes is None or m in modes}
    out[name], timelines = _bench_workload(w, chosen)
    if plot_dir:
      _plot_timelines(timelines, os.path.join(plot_dir, f"async_timeline_{name}.png"))
  out["samples_per_s"] = {
    w: {mode: r["samples_per_s"] for mode, r in out[w].items()} for w in workloads
  }
  for suffix, figure in (("", "samples_per_s"), ("_steady", "samples_per_s_steady")):
    out[f"speedup_async_vs_sync{suffix}"] = {
      w: _speedup(out[w], WORKLOADS[w].baseline, figure) for w in workloads
    }
  return out


def _speedup(results: dict, baseline: str, figure: str) -> float | None:
  """The fastest asynchronous mode (bound > 0) over the baseline."""
  sync = results.get(baseline, {}).get(figure)
  fastest = max((v[figure] or 0 for k, v in results.items() if "eta" in k), default=0)
  return fastest / sync if sync and fastest else None


def _plot_timelines(timelines: dict, path: str) -> None:
  """One panel per mode, each over a window of the same width ending at its last step: the
  longest of the modes' last `TIMELINE_STEPS` steps."""
  windows = {m: last_steps_window(segs, TIMELINE_STEPS) for m, segs in timelines.items()}
  width = max((w[1] - w[0] for w in windows.values() if w), default=None)
  panels = {}
  for mode, segs in timelines.items():
    end = windows[mode][1] if windows[mode] else max(e for _, _, e, _ in segs)
    start = end - width if width else 0.0
    panels[f"{mode}: the last {end - start:.2g} s"] = (segs, (start, end))
  plot_lanes(panels, path, lane_order=[LEARNER_LANE])


def _bench_workload(workload: Workload, modes: dict[str, dict]):
  steps, skip = workload.steps, workload.skip
  if any(o.get("loop.backend") == "ray" for o in modes.values()):
    _share_compilations_with_actors()
  base = {
    "task.sort_length": 4,
    "task.sort_length_max": 18,
    "rollout.sampling.max_new_tokens": 20,
    "rollout.paged.page_size": 32,
    "train.steps": steps,
    "train.loss.proximal": "recompute",
    "train.precompile": True,  # every batch length compiles before the run, in every mode
    "eval.every": steps,
    "eval.num_prompts": 128,
    "checkpoint.every": 0,
  }
  out, timelines = {}, {}
  for name, mode in modes.items():
    overrides = base | workload.overrides | mode
    cfg = load_config(os.path.join(REPO, "configs", "grpo_tiny.py"), None, overrides)
    workdir = tempfile.mkdtemp(prefix=f"bench_async_{name}_")
    c = job.build_controller(cfg, workdir, show_progress=False)
    job.warmup(c, cfg, show_progress=False)
    evals = c.run()
    timelines[name] = c.timeline.segments()
    c.timeline.save(os.path.join(workdir, "timeline.json"))
    c.close()
    if hasattr(c.learner, "kill"):  # a Ray learner: give its cores back for the next mode
      c.learner.kill()
    # Each mode compiles its own engines; drop their executables before the next mode (a
    # process that keeps every mode's runs out of memory maps for new ones).
    del c
    gc.collect()
    jax.clear_caches()
    train = [
      r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["kind"] == "train"
    ]
    timed = train[skip:]
    seconds = sum(r["time_step"] for r in timed)
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    samples = len(timed) * per_step
    stalled = compile_stalled_steps(timelines[name])
    if len(stalled) != len(train):
      raise RuntimeError(f"{name}: {len(stalled)} updates in the timeline, {len(train)} logged.")
    steady = [r for r, s in zip(train[skip:], stalled[skip:], strict=True) if not s]
    train_idle, rollout_idle = _idle_fractions(timelines[name], skip)
    if "loop.mode" in overrides and overrides["loop.mode"] == "async":
      off_policy = float(np.mean([r["off_policy_token_frac"] for r in timed]))
      staleness = float(np.mean([r["staleness_mean"] for r in timed]))
    else:
      off_policy = staleness = 0.0
    out[name] = {
      "samples_per_s": samples / seconds,
      # Over the timed steps during which nothing compiled (`steady_steps` of them).
      "samples_per_s_steady": len(steady) * per_step / sum(r["time_step"] for r in steady)
      if steady
      else None,
      "steady_steps": len(steady),
      "timed_steps": len(timed),
      "train_idle_frac": train_idle,
      "rollout_idle_frac": rollout_idle,
      "off_policy_token_frac": off_policy,
      "staleness_mean": staleness,
      "response_length": float(np.mean([r["response_length"] for r in train])),
      "eval_reward_start": evals.get("eval_reward_start"),
      "eval_reward_end": evals.get("eval_reward_end"),
      "reward_curve": [round(r["reward_mean"], 4) for r in train],
    }
  return out, timelines


def _idle_fractions(segments, skip: int) -> tuple[float, float]:
  """(learner, rollout) idle fractions over the timed steps, from the timeline: 1 - the time
  in "train" spans (learner) or "decode" spans (each rollout lane, averaged) over the window
  from the end of update `skip` to the end of the last."""
  ends = sorted(e for lane, _, e, kind in segments if lane == LEARNER_LANE and kind == "train")
  start, end = ends[skip - 1] if skip else 0.0, ends[-1]

  def busy(lane: str, kind: str) -> float:
    spans = [(s, e) for ln, s, e, k in segments if ln == lane and k == kind]
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans) / (end - start)

  rollout = {ln for ln, *_ in segments if ln.startswith("worker ")}
  return 1 - busy(LEARNER_LANE, "train"), 1 - float(np.mean([busy(ln, "decode") for ln in rollout]))


def _share_compilations_with_actors() -> None:
  """A persistent compilation cache for the Ray actors started from now on (they inherit this
  environment): the first mode's actors compile, later modes' load what they compiled. Fresh
  per run, so nothing carries over from an earlier one."""
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_async_jax_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
