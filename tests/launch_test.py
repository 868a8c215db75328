"""launch/train.py turns a bad command line into one clear message, not a traceback."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, *flags):
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "launch", "train.py"), f"--workdir={tmp_path}", *flags],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--config.train.stepz=3"], 'Did you mean "steps"'),
    (["--config.train.steps=abc"], "--config.train.steps=abc"),
    (
      ["--config=configs/grpo_tiny.py:fixed", "--config.placement.train_devices=6"],
      "this process has 8",
    ),
    (["--config.train.loss.aggregation=sum"], "config.train.loss"),
    (["--config.model.mlp_dim=4000000"], "config.placement.mode='planned'"),
  ],
)
def test_bad_command_line_gives_one_clear_message(tmp_path, flags, message):
  result = run_train(tmp_path, *flags)
  assert result.returncode != 0
  assert message in result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.rollout.group_size=0", "config.rollout.group_size must be >= 2"),
    ("--config.placement.train_mesh.fsdp=0", "config.placement.train_mesh.fsdp must be >= 1"),
    ("--config.train.micro_batch_size=5", "config.train.micro_batch_size=5: a step's"),
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
  """The default config (planned placement) on a one-device machine colocates the stages."""
  small = ["--config.warmup.steps=1", "--config.train.steps=2", "--config.eval.every=0"]
  small += ["--config.rollout.prompts_per_step=4", "--config.rollout.group_size=2"]
  small += ["--config.train.micro_batch_size=4", "--config.rollout.paged.max_running=8"]
  result = run_train(tmp_path, "--cpu_devices=1", *small)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "colocated on it" in result.stderr
  assert json.loads(result.stdout[result.stdout.index("{") :])["steps"] == 2
