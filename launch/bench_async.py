"""`python launch/bench.py async`: the RL loop's modes side by side on a long-tail workload.

The demo config (`configs/grpo_tiny.py`, tiny model on the 8 simulated CPU devices) with digit
sorting of long-tailed lengths (median 4 digits, capped at 18, so responses of 2-19 tokens),
the same warm-up and seed for every mode, and the same number of RL steps (so the same number
of samples). Modes: synchronous colocated and disaggregated (the sync controller), asynchronous
with staleness bound 1, 2 and 4 (workers finish their running responses before switching
weights), and asynchronous with bound 2 plus partial rollouts. Throughput is taken over the
steps after the first `skip` (compilation). Two training workloads (`WORKLOADS`): the demo's
and one with one optimizer update per step. The result
maps workload -> mode -> figures, plus `samples_per_s` and `speedup_async_vs_sync` (fastest
asynchronous mode over synchronous disaggregated) per workload; timelines of each mode's last
steps go to docs/images/async_timeline_<workload>.png.
"""

from __future__ import annotations

import gc
import os
import tempfile

import jax
import numpy as np

from jaxrl.config import load_config
from jaxrl.metrics import read_metrics
from jaxrl.rl import job
from jaxrl.rl.controller import ROLLOUT_LANE
from jaxrl.rl.timeline import LEARNER_LANE, last_steps_window
from jaxrl.scheduler.timeline import plot_lanes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {
  "sync_colocated": {"placement.mode": "colocated"},
  "sync_disaggregated": {},
  "async_eta1": {"loop.mode": "async", "loop.max_staleness": 1, "loop.partial_rollouts": False},
  "async_eta2": {"loop.mode": "async", "loop.max_staleness": 2, "loop.partial_rollouts": False},
  "async_eta4": {"loop.mode": "async", "loop.max_staleness": 4, "loop.partial_rollouts": False},
  "async_eta2_partial": {
    "loop.mode": "async",
    "loop.max_staleness": 2,
    "loop.partial_rollouts": True,
  },
}


# Training settings per workload. "demo": the demo's (two PPO updates per step of two
# micro-batches of 32). "one_update": one update per step over the same 128 samples (two
# micro-batches of 64): the same gradient compute, half the optimizer steps. On this CPU
# training is most of a synchronous step in both.
WORKLOADS = {
  "demo": {},
  "one_update": {"train.updates_per_step": 1, "train.micro_batch_size": 64},
}
TIMELINE_STEPS = 3  # steps shown per mode in the timeline plot


def bench_async(
  steps: int = 40,
  skip: int = 5,
  modes: tuple[str, ...] = tuple(MODES),
  workloads: tuple[str, ...] = tuple(WORKLOADS),
  plot_dir: str | None = os.path.join(REPO, "docs", "images"),
) -> dict:
  """Per workload: samples/s, idle fractions, off-policy tokens and reward per mode, one run;
  with `plot_dir`, a timeline of each mode's last steps to `async_timeline_<workload>.png`."""
  out = {}
  for workload in workloads:
    out[workload], timelines = _bench_workload(steps, skip, modes, WORKLOADS[workload])
    if plot_dir:
      _plot_timelines(timelines, os.path.join(plot_dir, f"async_timeline_{workload}.png"))
  out["samples_per_s"] = {
    w: {mode: r["samples_per_s"] for mode, r in out[w].items()} for w in workloads
  }
  out["speedup_async_vs_sync"] = {w: _speedup(out[w]) for w in workloads}
  return out


def _speedup(results: dict) -> float | None:
  sync = results.get("sync_disaggregated", {}).get("samples_per_s")
  fastest = max(
    (v["samples_per_s"] for k, v in results.items() if k.startswith("async")), default=0
  )
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
  plot_lanes(panels, path, lane_order=[LEARNER_LANE, ROLLOUT_LANE])


def _bench_workload(steps: int, skip: int, modes: tuple[str, ...], training: dict):
  base = {
    "task.sort_length": 4,
    "task.sort_length_max": 18,
    "rollout.sampling.max_new_tokens": 20,
    "rollout.paged.page_size": 32,
    "train.steps": steps,
    "train.loss.proximal": "recompute",
    "eval.every": steps,
    "eval.num_prompts": 128,
    "checkpoint.every": 0,
  }
  out, timelines = {}, {}
  for name in modes:
    overrides = base | training | MODES[name]
    cfg = load_config(os.path.join(REPO, "configs", "grpo_tiny.py"), None, overrides)
    workdir = tempfile.mkdtemp(prefix=f"bench_async_{name}_")
    c = job.build_controller(cfg, workdir, show_progress=False)
    job.warmup(c, cfg, show_progress=False)
    evals = c.run()
    timelines[name] = c.timeline.segments()
    rollout_busy_s = getattr(c, "rollout_busy_s", 0.0)
    c.writer.close()
    c.checkpointer.close()
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
    samples = len(timed) * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if cfg.loop.mode == "async":
      train_idle = sum(r["time_wait"] for r in timed) / seconds
      total = sum(r["time_step"] for r in train)
      rollout_idle = 1 - rollout_busy_s / (cfg.loop.rollout_workers * total)
      off_policy = float(np.mean([r["off_policy_token_frac"] for r in timed]))
      staleness = float(np.mean([r["staleness_mean"] for r in timed]))
    else:
      train_idle = 1 - sum(r["time_train"] for r in timed) / seconds
      rollout_idle = 1 - sum(r["time_rollout"] for r in timed) / seconds
      off_policy = staleness = 0.0
    out[name] = {
      "samples_per_s": samples / seconds,
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
