"""launch/train.py turns a bad command line into one clear message, not a traceback."""

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
  "flag, message",
  [
    ("--config.train.stepz=3", 'Did you mean "steps"'),
    ("--config.train.steps=abc", "--config.train.steps=abc"),
    ("--config.placement.train_devices=6", "this process has 8"),
    ("--config.train.loss.aggregation=sum", "config.train.loss"),
  ],
)
def test_bad_command_line_gives_one_clear_message(tmp_path, flag, message):
  result = run_train(tmp_path, flag)
  assert result.returncode != 0
  assert message in result.stderr
  assert "Traceback" not in result.stderr
