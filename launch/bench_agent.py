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


def bench_turn_kv(episodes: int = 32, steps: int = 2) -> dict:
  """`python launch/bench.py turn_kv`: multi-turn rollouts with each turn's KV pages kept for
  the next (`rollout.paged.keep_turn_kv`) and without, on the same engine settings and seeds.

  `episodes` games of guess-the-number (`GuessNumberEnv`, six guesses of up to 8 tokens) by the
  tiny model from a random initialisation, whose guesses are rarely right: most episodes take
  every turn, and turn k's prompt is the whole game so far. Per setting: `prefill_tokens`, the
  tokens its prefill calls computed; `kept_tokens`, those kept pages spared; `wall_s`, the
  rollout's time, the best of `steps` runs after one that compiles; and whether the
  trajectories (ids and log-probs) were the same with and without.
  """
  import jax
  import numpy as np

  from jaxrl.data.tokenizer import CharTokenizer
  from jaxrl.envs import EpisodeLimits, GuessNumberEnv
  from jaxrl.envs import guess_number as game
  from jaxrl.model import Model, get_preset
  from jaxrl.rl.multi_turn import MultiTurnRollout
  from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh

  tokenizer = CharTokenizer()
  model = Model(get_preset("tiny", vocab_limit=tokenizer.vocab_size, max_seq_len=512))
  mesh = make_mesh(jax.devices()[:1], {"data": 1})
  params = model.init(0)
  records = game.records("train", episodes, 0, max_low=100, widths=(50,))
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
  out, trajectories = {}, {}
  for keep in (True, False):
    config = PagedConfig(page_size=16, num_pages=1024, max_running=episodes, keep_turn_kv=keep)
    engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=tokenizer.eos_id, pad_id=0,
                         config=config)  # fmt: skip
    engine.update_weights(params, 0)
    rollout = MultiTurnRollout(
      engine,
      tokenizer,
      lambda: GuessNumberEnv(max_guesses=6),
      EpisodeLimits(max_turns=6, step_timeout_s=60),
      max_tokens=500,
    )
    walls = []
    for run in range(steps + 1):
      prefilled, kept = engine.num_prefill_tokens, engine.num_kept_prefill_tokens
      start = time.perf_counter()
      result = rollout.run(records, sampling, seed=run)
      walls.append(time.perf_counter() - start)
    trajectories[keep] = result.trajectories
    turns = [t.turns for t in result.trajectories]
    out["keep" if keep else "no_keep"] = {
      "prefill_tokens": engine.num_prefill_tokens - prefilled,
      "kept_tokens": engine.num_kept_prefill_tokens - kept,
      "turns_mean": float(np.mean(turns)),
      "trajectory_tokens_mean": float(np.mean([len(t.token_ids) for t in result.trajectories])),
      "wall_s": round(min(walls[1:]), 2),
      "preemptions": engine.num_preemptions,
    }
  same = all(
    a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    for a, b in zip(trajectories[True], trajectories[False], strict=True)
  )
  out["prefill_tokens_ratio"] = out["keep"]["prefill_tokens"] / out["no_keep"]["prefill_tokens"]
  out["same_trajectories"] = same
  return out
