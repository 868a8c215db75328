"""The pieces of a job every backend builds the same way: the learner `config.train` describes,
the inputs a backend builds from (`JobParts`), and the split of the rollout devices among the
workers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.model import Model
from jaxrl.rl.placement import Placement
from jaxrl.rl.policy import initial_params
from jaxrl.sharding import STAGE_RULES, split_devices
from jaxrl.train.learner import Learner
from jaxrl.train.packing import auto_pack_length


@dataclasses.dataclass(frozen=True)
class JobParts:
  """What every backend builds its pieces from: the resolved config, where the stages run, the
  rollout model and tokenizer, and a typical prompt length (for the workers' predicted rate)."""

  cfg: ExperimentConfig
  placement: Placement
  rollout_model: Model
  tokenizer: Any
  prompt_len: int


def worker_count(cfg: ExperimentConfig, num_devices: int, replica_devices: int) -> int:
  """Rollout workers over `num_devices` rollout devices: `config.loop.rollout_workers`, or for
  0 one in sync mode (all devices, as one engine) and two in async mode where the devices
  split evenly into two workers of whole engine replicas (`replica_devices`: the devices of
  the rollout mesh's axes but `data`), so that a worker switching weights leaves the other
  decoding; else one."""
  if cfg.loop.rollout_workers:
    return cfg.loop.rollout_workers
  halves = num_devices % (2 * replica_devices) == 0
  return 2 if cfg.loop.mode == "async" and halves else 1


def rollout_device_groups(parts: JobParts) -> list[list[jax.Device]]:
  """The rollout devices split evenly among the workers (`worker_count`)."""
  mesh = parts.placement.rollout_mesh
  devices = list(mesh.devices.flat)
  replica = math.prod(size for axis, size in mesh.shape.items() if axis != "data")
  n = worker_count(parts.cfg, len(devices), replica)
  if len(devices) % n:
    planned = parts.cfg.placement.mode == "planned"
    raise ConfigError(
      f"config.loop.rollout_workers={n} does not divide the {len(devices)} rollout devices"
      + (
        " the planner chose (config.placement.mode='planned'); set rollout_workers=0 (chosen "
        "by the loop mode), or place the stages by hand (placement.mode='disaggregated')."
        if planned
        else "; choose a divisor."
      )
    )
  return split_devices(devices, [len(devices) // n] * n)


def make_learner(cfg: ExperimentConfig, model: Model, mesh) -> Learner:
  """The learner `cfg.train` describes, on `mesh`, checked against the batch rollout makes."""
  train = cfg.train
  try:
    learner = Learner(
      model,
      mesh,
      STAGE_RULES["train"],
      loss=train.loss,
      optimizer=train.optimizer,
      updates_per_step=train.updates_per_step,
      micro_batch_size=train.micro_batch_size,
      temperature=cfg.rollout.sampling.temperature,
      seed=cfg.seed,
      moe=train.moe,
      logprob_chunk=train.logprob_chunk,
      # -1 (auto) is resolved from the task's prompts by `build_controller`; built without it,
      # rows as long as the model's longest sequence.
      pack_length=train.pack_length
      if train.pack_length >= 0
      else auto_pack_length(model.config.max_seq_len, cfg.rollout.sampling.max_new_tokens, None),
      params=initial_params(cfg, model, mesh),
    )
  except ValueError as e:
    raise ConfigError(f"config.train: {e}") from None
  try:
    learner.check_batch_size(cfg.rollout.prompts_per_step * cfg.rollout.group_size)
  except ValueError as e:
    raise ConfigError(f"config.train: {e}") from None
  return learner
