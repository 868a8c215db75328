"""`python launch/bench.py agent`: multi-turn RL with slow, long-tailed environment steps.

The agent demo (`configs/grpo_agent.py`: the tiny model, the guessing game, 8 prompts x 8
episodes a step) with the environment `guess_number_delayed`: each step of an episode waits a
lognormal time with median 0.5 s and shape 1.2 (mean 1.0 s; about 1 step in 100 over 8 s, the
longest of a run over 10 s), as a remote tool would, without holding a thread. No warm-up and no
evaluation: the policy is the random initialisation, whose turns are rarely right, so episodes
run to their six guesses and every step has 64 episodes of six environment steps each.

Modes: "sync" (the staleness bound 0: a step's episodes are generated, then trained, then the
next step's released) and asynchronous with bounds 1 and 4 (the next steps' episodes decode
while earlier ones wait for their environments and while the learner trains), on the same two
rollout workers. Per mode, over the steps after the first (compilation):

- `samples_per_s`: episodes trained per second of wall time;
- `rollout_idle_env_frac`: the fraction of that time during which no rollout worker had a
  request to decode while some episode was waiting for its environment (the rollout devices
  idle because of the environments), and `rollout_idle_frac`: idle for any reason (the learner
  training in sync mode, admission waiting on the staleness bound);
- `env_wait_s_max`: the longest single environment step seen.
Sampled at every pass of the controller's loop (at least every 50 ms).
"""

from __future__ import annotations

import os
import tempfile
import time

from jaxrl.config import load_config
from jaxrl.rl import job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DELAY = {"delay_s": 0.5, "delay_sigma": 1.2, "say_range": True}
MODES = {
  "sync": {"loop.mode": "sync"},
  "async_eta1": {"loop.mode": "async", "loop.max_staleness": 1},
  "async_eta4": {"loop.mode": "async", "loop.max_staleness": 4},
}


class IdleMeter:
  """Integrates, over the controller's loop passes, the time no request was on a worker."""

  def __init__(self):
    self.last = None
    self.idle_s = self.idle_env_s = self.total_s = 0.0
    self.waits = {}  # (gid, j) -> when its environment step started
    self.longest_wait_s = 0.0

  def __call__(self, controller) -> None:
    now = time.perf_counter()
    if controller.state.step < 1:  # the first step compiles: not measured
      self.last = now
      return
    waiting = set()
    for group in controller.groups.values():
      for j, episode in enumerate(group.episodes or ()):
        if episode.phase == "env":
          waiting.add((group.gid, j))
    for key in waiting - set(self.waits):
      self.waits[key] = now
    for key in set(self.waits) - waiting:
      self.longest_wait_s = max(self.longest_wait_s, now - self.waits.pop(key))
    if self.last is not None:
      dt = now - self.last
      self.total_s += dt
      if not controller.assigned:
        self.idle_s += dt
        if waiting:
          self.idle_env_s += dt
    self.last = now


def run_mode(overrides: dict, steps: int) -> dict:
  cfg = load_config(
    os.path.join(REPO, "configs", "grpo_agent.py"),
    None,
    {
      "env.name": "guess_number_delayed",
      "env.kwargs": DELAY,
      "env.limits.step_timeout_s": 60.0,
      "warmup.steps": 0,
      "eval.every": 0,
      "checkpoint.every": 0,
      "train.steps": steps,
      "loop.rollout_workers": 2,
      "placement.mode": "disaggregated",  # 4 + 4 devices: the same workers in every mode
      **overrides,
    },
  )
  with tempfile.TemporaryDirectory() as workdir:
    controller = job.build_controller(cfg, workdir, show_progress=False)
    meter = IdleMeter()
    controller.hooks.append(meter)
    start = {}

    def mark(c):
      if c.state.step == 1:
        start["t"] = time.perf_counter()

    controller.on_step.append(mark)
    controller.run()
    wall = time.perf_counter() - start["t"]
    controller.close()
    controller.writer.close()
    controller.checkpointer.close()
  samples = (steps - 1) * cfg.rollout.prompts_per_step * cfg.rollout.group_size
  return {
    "mode": cfg.loop.mode,
    "max_staleness": cfg.loop.max_staleness if cfg.loop.mode == "async" else 0,
    "steps_timed": steps - 1,
    "wall_s": round(wall, 2),
    "samples_per_s": samples / wall,
    "rollout_idle_env_frac": meter.idle_env_s / meter.total_s,
    "rollout_idle_frac": meter.idle_s / meter.total_s,
    "env_wait_s_max": round(meter.longest_wait_s, 2),
  }


def bench_agent(steps: int = 6, modes=tuple(MODES)) -> dict:
  out = {name: run_mode(MODES[name], steps) for name in modes}
  if "sync" in out:
    for name in modes:
      out[name]["speedup_vs_sync"] = out[name]["samples_per_s"] / out["sync"]["samples_per_s"]
  return out
