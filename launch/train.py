"""Runs an RL job.

  python launch/train.py --config configs/grpo_tiny.py --workdir /tmp/grpo_tiny \
      [--config.train.steps=100 ...] [--cpu_devices=8]

With no flags it runs the tiny demo config in ./runs/grpo_tiny.
"""

import json
import logging
import os
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
  _CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(_REPO, "configs", "grpo_tiny.py"),
    "Experiment config file.",
    lock_config=True,
  )
except (AttributeError, KeyError) as e:
  # ml_collections resolves `--config.a.b=v` overrides while defining the flag; an unknown key
  # surfaces here, with its "Did you mean" hint in the message.
  hint = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
  sys.exit(f"Config error: an override names a key the config does not have: {hint}")
_WORKDIR = flags.DEFINE_string(
  "workdir", os.path.join("runs", "grpo_tiny"), "Directory for metrics, checkpoints and plots."
)
_CPU_DEVICES = flags.DEFINE_integer(
  "cpu_devices", 8, "Simulated devices when JAX runs on the CPU (ignored on accelerators)."
)


def _stop(kind: str, error: Exception, workdir: str) -> None:
  """Exits with one line naming what stopped the run; its traceback goes to
  `<workdir>/error.txt`, for an environment's or a checkpoint's author to read."""
  path = os.path.join(workdir, "error.txt")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w") as f:
      f.write("".join(traceback.format_exception(error)))
    where = f" (traceback: {path})"
  except OSError as e:
    where = f" (its traceback could not be written to {path}: {e})"
  sys.exit(f"{kind}: {error}{where}")


def main(argv):
  del argv
  import jax

  # Must happen before the backend starts; only affects the CPU platform.
  jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  from jaxrl.config import ConfigError, from_config_dict
  from jaxrl.data import DatasetError, TokenizerError
  from jaxrl.envs import EnvError
  from jaxrl.model.safetensors_io import CheckpointError
  from jaxrl.rl import job
  from jaxrl.rl.worker_pool import RolloutWorkersLost

  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  try:
    cfg = from_config_dict(_CONFIG.value)
    summary = job.run(cfg, _WORKDIR.value)
  except ConfigError as e:
    sys.exit(f"Config error: {e}")
  except DatasetError as e:
    sys.exit(f"Dataset error: {e}")
  # Errors a run meets on its way, each with a message that says what to change: one line
  # here rather than a page of traceback above it.
  except EnvError as e:
    _stop("Environment error", e, _WORKDIR.value)
  except CheckpointError as e:
    _stop("Checkpoint error", e, _WORKDIR.value)
  except TokenizerError as e:
    _stop("Tokenizer error", e, _WORKDIR.value)
  except RolloutWorkersLost as e:
    _stop("Rollout workers lost", e, _WORKDIR.value)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
