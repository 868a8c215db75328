"""launch/train.py turns a bad command line into one clear message, not a traceback."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, *flags, env=None):
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "launch", "train.py"), f"--workdir={tmp_path}", *flags],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(env or os.environ, JAX_PLATFORMS="cpu"),
  )


# Each case starts a process (imports alone take seconds on 2 cores). A config that fails when
# it is converted is test_bad_value_is_one_line_naming_its_key's case; the aggregation one is
# `slow` (config_test checks its message in this process).
@pytest.mark.parametrize(
  "flags, message",
  [
    (["--config.train.stepz=3"], 'Did you mean "steps"'),
    (["--config.train.steps=abc"], "--config.train.steps=abc"),
    (
      ["--config=configs/grpo_tiny.py:fixed", "--config.placement.train_devices=6"],
      "this process has 8",
    ),
    pytest.param(
      ["--config.train.loss.aggregation=sum"], "config.train.loss", marks=pytest.mark.slow
    ),
    (["--config.model.mlp_dim=4000000"], "config.placement.mode='planned'"),
  ],
)
def test_bad_command_line_gives_one_clear_message(tmp_path, flags, message):
  result = run_train(tmp_path, *flags)
  assert result.returncode != 0
  assert message in result.stderr
  assert "Traceback" not in result.stderr


# One value by default: the three take the same path (a `ConfigError` when the config is
# converted, printed as one line); config_test checks every such message in this process.
@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.rollout.group_size=0", "config.rollout.group_size must be >= 2"),
    pytest.param(
      "--config.placement.train_mesh.fsdp=0",
      "config.placement.train_mesh.fsdp must be >= 1",
      marks=pytest.mark.slow,
    ),
    pytest.param(
      "--config.train.micro_batch_size=5",
      "config.train.micro_batch_size=5: a step's",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_bad_value_is_one_line_naming_its_key(tmp_path, flag, message):
  """Caught when the config is converted: the user sees that line and nothing else."""
  result = run_train(tmp_path, flag)
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("Config error: "), result.stderr
  assert message in lines[0]


def test_main_job_runs_on_one_device_as_shipped(tmp_path):
  """The default config (planned placement) on a one-device machine colocates the stages; its
  compiled programs go to `config.compile_cache_dir` (here a fresh one, and without the test
  suite's cache in the environment, which would win)."""
  small = ["--config.warmup.steps=1", "--config.train.steps=2", "--config.eval.every=0"]
  small += ["--config.rollout.prompts_per_step=4", "--config.rollout.group_size=2"]
  small += ["--config.train.micro_batch_size=4", "--config.rollout.paged.max_running=8"]
  cache = tmp_path / "xla_cache"
  small += [f"--config.compile_cache_dir={cache}"]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  result = run_train(tmp_path / "run", "--cpu_devices=1", *small, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "colocated on it" in result.stderr
  assert json.loads(result.stdout[result.stdout.index("{") :])["steps"] == 2
  assert f"Compiled programs are cached in {cache}" in result.stderr
  assert any(cache.iterdir())


# `slow` (about 3 minutes on 2 cores: two runs with a supervised warm-up long enough that the
# RL steps see rewards, so their losses are not all zero). Run with `pytest -m slow`.
# On the 2-core VM, with the XLA flags conftest sets (inherited by the job's Ray actors), the
# learner actor used to abort 1-2 times a run on an XLA:CPU all-reduce that waited 40 s for its
# participants, and the run outlasted its 300 s: the step's metrics were averaged as ~50 small
# programs queued behind the update's. One program now (`jaxrl.train.update_metrics`).
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_a_learner_of_two_processes_trains_as_one_process_does(tmp_path):
  """`--config.train.num_processes=2`: the learner is two Ray actors joined into one JAX world
  over the same training mesh; the run's per-step losses are the one-process run's."""
  pytest.importorskip("ray", reason="the `ray` extra is not installed")
  losses = {}
  for n in (1, 2):
    workdir = tmp_path / f"p{n}"
    result = run_train(
      workdir,
      "--config=configs/grpo_tiny.py:test",
      "--config.loop.mode=sync",
      "--config.loop.backend=ray",
      f"--config.train.num_processes={n}",
      "--config.warmup.steps=60",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(workdir / "metrics.jsonl") as f:
      records = [json.loads(line) for line in f]
    losses[n] = [(r["kind"], r["step"], r["loss"]) for r in records if "loss" in r]
    assert any(r.get("reward_mean", 0) > 0 for r in records)  # the RL losses are not all 0
  assert [k[:2] for k in losses[1]] == [k[:2] for k in losses[2]]
  for (_, step, one), (_, _, two) in zip(losses[1], losses[2], strict=True):
    assert abs(one - two) <= 1e-4, (step, one, two)


def test_every_launch_script_imports():
  """The benchmarks and tools import (a renamed library name breaks them before they run)."""
  names = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "launch")) if f.endswith(".py"))
  code = "import sys; sys.path.insert(0, 'launch')\n" + "\n".join(f"import {n}" for n in names)
  done = subprocess.run(
    [sys.executable, "-c", code],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert done.returncode == 0, done.stderr[-3000:]


# A run stopped by what it meets on its way (here `job.run` raises it at once): one line naming
# the error, and its traceback kept in the workdir.
_RAISE_IN_RUN = """
import runpy, sys
from jaxrl.rl import job
from jaxrl.envs import EnvError
from jaxrl.model.safetensors_io import CheckpointError
from jaxrl.rl.worker_pool import RolloutWorkersLost

def run(cfg, workdir):
  raise {error}

job.run = run
sys.argv = ["train.py", "--workdir={workdir}"]
runpy.run_path("launch/train.py", run_name="__main__")
"""


@pytest.mark.parametrize(
  "error, line",
  [
    ("EnvError('record 3: no target')", "Environment error: record 3: no target"),
    ("CheckpointError('shard 2 is truncated')", "Checkpoint error: shard 2 is truncated"),
    ("RolloutWorkersLost('none for 60 s')", "Rollout workers lost: none for 60 s"),
  ],
)
def test_an_error_met_in_the_run_is_one_line_with_its_traceback_kept(tmp_path, error, line):
  code = _RAISE_IN_RUN.format(error=error, workdir=tmp_path)
  result = subprocess.run(
    [sys.executable, "-c", code],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert lines == [f"{line} (traceback: {tmp_path / 'error.txt'})"], result.stderr
  kept = (tmp_path / "error.txt").read_text()
  assert kept.startswith("Traceback") and "in run" in kept
