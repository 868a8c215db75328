"""`python launch/bench.py async`: the RL loop's modes side by side on a long-tail workload.

The demo config (`configs/grpo_tiny.py`, tiny model on the 8 simulated CPU devices) with digit
sorting of long-tailed lengths (median 4 digits, capped at 18, so responses of 2-19 tokens),
the same warm-up and seed for every mode, and the same number of RL steps (so the same number
of samples). Modes: synchronous colocated and disaggregated (the sync controller), asynchronous
with staleness bound 1, 2 and 4 (workers finish their running responses before switching
weights), and asynchronous with bound 2 plus partial rollouts. Throughput is taken over the
steps after the first `skip` (compilation).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from jaxrl.config import load_config
from jaxrl.metrics import read_metrics
from jaxrl.rl import job

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


def bench_async(steps: int = 40, skip: int = 5, modes: tuple[str, ...] = tuple(MODES)) -> dict:
  """samples/s, idle fractions, off-policy tokens and reward per mode, one run."""
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
  out = {}
  for name in modes:
    cfg = load_config(os.path.join(REPO, "configs", "grpo_tiny.py"), None, base | MODES[name])
    workdir = tempfile.mkdtemp(prefix=f"bench_async_{name}_")
    c = job.build_controller(cfg, workdir, show_progress=False)
    job.warmup(c, cfg, show_progress=False)
    evals = c.run()
    c.writer.close()
    c.checkpointer.close()
    train = [
      r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["kind"] == "train"
    ]
    timed = train[skip:]
    seconds = sum(r["time_step"] for r in timed)
    samples = len(timed) * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if cfg.loop.mode == "async":
      train_idle = sum(r["time_wait"] for r in timed) / seconds
      total = sum(r["time_step"] for r in train)
      rollout_idle = 1 - c.rollout_busy_s / (cfg.loop.rollout_workers * total)
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
  sync = out.get("sync_disaggregated", {}).get("samples_per_s")
  fastest = max((v["samples_per_s"] for k, v in out.items() if k.startswith("async")), default=0)
  out["summary"] = {
    "samples_per_s": {k: v["samples_per_s"] for k, v in out.items()},
    "speedup_async_vs_sync": fastest / sync if sync and fastest else None,
  }
  return out
