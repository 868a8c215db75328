"""Chaos: an async run on the two-type Ray rig under random faults, against the same run without.

  python launch/bench.py chaos [--json] [--faults ROLLOUT,LEARNER,CRASH]

The rig (`configs/clusters/ray_rig.py`) is a local `ray.cluster_utils.Cluster` of two raylets:
one node of the `fast` pool (fake H100) and one of the `cheap` pool (fake L4); the job plans the
stages for it (`loop.ray_cluster`) and starts the learner and the rollout instances on the nodes
of the pools the plan chose. The tiny demo model trains in async mode (max_staleness 2) with a
checkpoint every step. Faults come at random loop iterations until each count is spent (default
100 rollout kills, 10 learner kills, 10 whole-job crashes):
- a rollout process killed: half with a preemption notice (the worker hands its requests back
  and leaves), half without (its actor is killed; its requests go on elsewhere from their last
  streamed tokens); a new worker takes the slot;
- a learner process killed: the next learner call raises `LearnerLost`, and the run goes on
  from the last checkpoint with a new learner and workers, as `job.run` does;
- the whole job crashed: the controller is dropped mid-step, and a new one resumes from the
  last checkpoint (`--config.resume=True`).

A ledger follows every group released: the groups trained on the final line of history (what a
crash undid after its checkpoint is undone in the ledger too), how often each was trained, and
the prompts in release order. Reported: samples lost (released groups neither trained nor held
at the end; target 0), samples trained twice (target 0), prompts skipped (the released prompts
against the loader's own order; target 0), the oldest token trained, in versions behind the
weights it trained, against the bound, the faults injected, and the wall time against the same
run without faults (both runs in this process, one after the other).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

from jaxrl.config import load_config
from jaxrl.data.pipeline import PromptLoader
from jaxrl.data.tasks import make_task
from jaxrl.rl import job
from jaxrl.rl.backends import LearnerLost
from jaxrl.rl.ray_cluster import pool_resource

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RIG = os.path.join(_REPO, "configs", "clusters", "ray_rig.py")
MAX_STALENESS = 2


class Crash(Exception):
  """A whole-job crash, injected."""


def chaos_config(steps: int, workdir_seed: int):
  """The tiny job in async mode on the rig, cut to short responses: every step checkpointed."""
  overrides = {
    "seed": workdir_seed,
    "warmup.steps": 0,
    "eval.every": 0,
    "loop.mode": "async",
    "loop.backend": "ray",
    "loop.ray_cluster": RIG,
    "loop.max_staleness": MAX_STALENESS,
    "rollout.sampling.max_new_tokens": 8,
    "rollout.paged.decode_steps": 2,
    "rollout.paged.max_running": 8,
    "rollout.paged.page_size": 32,
    "train.steps": steps,
    "checkpoint.every": 1,
    "resume": True,
    # Every actor compiles cold, in both runs, as in the recorded figures: a persistent cache
    # would hand the clean run's programs (or an earlier invocation's) to the chaos run.
    "compile_cache_dir": "",
  }
  return load_config(os.path.join(_REPO, "configs", "grpo_tiny.py"), "test", overrides)


class Ledger:
  """What was trained, how often, and which prompt each group held, across restarts."""

  def __init__(self):
    self.trained: dict[int, list[int]] = {}  # gid -> steps it was trained at
    self.prompts: dict[int, str] = {}  # gid -> prompt id
    self.oldest_lag = 0  # versions between a trained token and the weights it trained

  def attach(self, controller) -> None:
    controller.on_train.append(self.on_train)
    controller.hooks.append(self.watch)

  def watch(self, controller) -> None:
    for group in controller.groups.values():
      self.prompts[group.gid] = group.prompt["id"]

  def on_train(self, step: int, groups) -> None:
    for group in groups:
      self.trained.setdefault(group.gid, []).append(step)
      self.prompts[group.gid] = group.prompt["id"]
      self.oldest_lag = max(self.oldest_lag, step - group.oldest_version())

  def undo_after(self, step: int) -> None:
    """A restart from the checkpoint of `step`: what was trained after it is undone."""
    for gid in list(self.trained):
      kept = [s for s in self.trained[gid] if s < step]
      if kept:
        self.trained[gid] = kept
      else:
        del self.trained[gid]

  def report(self, controller, cfg) -> dict:
    self.watch(controller)  # the groups released after the last step
    held = set(controller.groups)
    released = range(controller.next_group)
    loader = PromptLoader(
      make_task(cfg.task).records("train", None, cfg.seed),
      batch_size=cfg.rollout.prompts_per_step,
      seed=cfg.seed,
    )
    expected = [r["id"] for _ in range(len(released) // cfg.rollout.prompts_per_step + 1)
                for r in next(loader)]  # fmt: skip
    return {
      "groups_released": len(released),
      "samples_lost": sum(1 for g in released if g not in self.trained and g not in held)
      * cfg.rollout.group_size,
      "samples_trained_twice": sum(len(s) - 1 for s in self.trained.values())
      * cfg.rollout.group_size,
      "prompts_skipped": sum(1 for g in released if self.prompts.get(g) != expected[g]),
      "oldest_token_lag": self.oldest_lag,
      "max_staleness": cfg.loop.max_staleness,
    }


def _discard(controller) -> None:
  """Drops a controller whose run ended in a fault: its files closed, its actors gone."""
  controller.close()
  for kill in (controller.learner.kill, controller.stop_workers):
    with contextlib.suppress(Exception):  # already dead: nothing more to free
      kill()
  ray.kill(controller.weights.actor, no_restart=True)


def run_job(cfg, workdir: str, faults: dict[str, int], rng: np.random.Generator) -> dict:
  """One run to `train.steps`, resumed after every fault; returns its ledger and counts."""
  ledger = Ledger()
  left = dict(faults)
  done = {k: 0 for k in faults}
  replaced = iter(range(10**9))
  counters = {"learner_restarts": 0, "job_restarts": 0}
  pace = {"iterations": 0, "first_step": None}
  start = time.perf_counter()
  while True:
    controller = job.build_controller(cfg, workdir, show_progress=False)
    latest = controller.checkpointer.latest_step()
    if latest is None:
      controller.save()
    else:
      controller.restore(latest)
      ledger.undo_after(latest)
    ledger.attach(controller)
    names = [w.name for w in controller.initial_workers]
    slots = dict(zip(names, controller.backend.worker_slots(), strict=True))

    learner_killed = []  # nothing more is injected until the kill surfaces as LearnerLost

    def inject(c, slots=slots, learner_killed=learner_killed):
      """Spreads the faults left over the steps left, at the loop's pace so far."""
      if learner_killed:
        return
      pace["iterations"] += 1
      if pace["first_step"] is None:
        pace["first_step"] = c.state.step
      stepped = max(1, c.state.step - pace["first_step"])
      per_step = max(10.0, pace["iterations"] / stepped)
      steps_left = max(1, cfg.train.steps - c.state.step - 1)
      if rng.random() > sum(left.values()) / (steps_left * per_step):
        return
      kinds = [k for k, n in left.items() if n]
      weights = np.array([left[k] for k in kinds], float)
      kind = str(rng.choice(kinds, p=weights / weights.sum()))
      if kind == "rollout":
        live = [n for n in c.workers if n not in c.leaving]
        if not live:
          return
        victim = str(rng.choice(live))
        if done["rollout"] % 2:
          c.kill_worker(victim)
        else:
          c.remove_worker(victim)  # a preemption notice: it hands back and leaves
        name = f"r{next(replaced)}"
        slots[name] = slots.pop(victim)
        c.add_worker(c.make_worker(name, slots[name]))  # Ray starts it once the slot frees
      elif kind == "learner":
        actors = c.learner._actors  # one process of the gang, killed without a word
        ray.kill(actors[int(rng.integers(len(actors)))], no_restart=True)
        learner_killed.append(c.state.step)
      left[kind] -= 1
      done[kind] += 1
      if kind == "crash":
        raise Crash

    controller.hooks.append(inject)
    try:
      controller.run()
      break
    except LearnerLost:
      counters["learner_restarts"] += 1
      _discard(controller)
    except Crash:
      counters["job_restarts"] += 1
      _discard(controller)
  wall = time.perf_counter() - start
  result = ledger.report(controller, cfg)
  _discard(controller)
  return {**result, "faults": done, **counters, "wall_s": round(wall, 1)}


def bench_chaos(faults: tuple[int, int, int] = (100, 10, 10), steps: int = 30) -> dict:
  """The faulty run and the clean one on a fresh rig (see the module docstring)."""
  cluster = Cluster(
    initialize_head=True, head_node_args={"num_cpus": 1, "resources": {pool_resource("fast"): 1}}
  )
  cluster.add_node(num_cpus=1, resources={pool_resource("cheap"): 4})
  ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
  rng = np.random.default_rng(0)
  try:
    out = {}
    with tempfile.TemporaryDirectory() as clean, tempfile.TemporaryDirectory() as faulty:
      cfg = chaos_config(steps, 0)
      out["clean"] = run_job(cfg, clean, {"rollout": 0, "learner": 0, "crash": 0}, rng)
      kinds = dict(zip(("rollout", "learner", "crash"), faults, strict=True))
      out["chaos"] = run_job(cfg, faulty, kinds, rng)
    out["wall_overhead"] = round(out["chaos"]["wall_s"] / out["clean"]["wall_s"], 2)
    return out
  finally:
    ray.shutdown()
    cluster.shutdown()
