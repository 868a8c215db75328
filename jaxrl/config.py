"""Experiment configuration: frozen dataclasses, built once from an ml_collections ConfigDict.

Config files (`configs/*.py`) start from `default_config()`, a ConfigDict holding every field
below with its default, and change what they need. Launch scripts call `from_config_dict` once;
library code then sees only these dataclasses. Every default lives in exactly one field here or
in the dataclass a field points to.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib.util
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from jaxrl.auto_config import resolve_auto
from jaxrl.data.tasks import TaskConfig
from jaxrl.envs.registry import EnvConfig
from jaxrl.model.config import DTYPES, ModelConfig
from jaxrl.model.presets import get_preset
from jaxrl.rollout.paged_config import PagedConfig
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.train.advantages import ADVANTAGE_MODES
from jaxrl.train.losses import LossConfig
from jaxrl.train.optimizer import OptimizerConfig
from jaxrl.train.routing import MoEConfig


class ConfigError(ValueError):
  """A config key or value that cannot be used; the message names the key's full path."""


def _check_at_least(section: str, config, minimum: int, *names: str) -> None:
  """Raises for the first of `names` (fields of `config`, at `config.<section>`) below
  `minimum`, naming its full key."""
  for name in names:
    value = getattr(config, name)
    if value < minimum:
      raise ConfigError(f"config.{section}.{name} must be >= {minimum}, got {value}.")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ConfigError(f"{key}={value!r}: use one of {choices}.")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; at most one may be -1 (use the remaining devices)."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1

  def axes(self) -> dict[str, int]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Which devices run rollout and training.

  Attributes:
    mode: "disaggregated" (rollout and training on disjoint device groups), "colocated" (both
      stages share one mesh of `train_devices` devices) or "planned" (disaggregated, with the
      device counts and mesh shapes chosen by the scheduler's planner for this model and step;
      the four fields below are then ignored).
    rollout_devices: devices of the rollout mesh (disaggregated mode).
    train_devices: devices of the training mesh.
    rollout_mesh: axis sizes of the rollout mesh.
    train_mesh: axis sizes of the training mesh.
  """

  mode: str = "disaggregated"
  rollout_devices: int = 4
  train_devices: int = 4
  rollout_mesh: MeshConfig = MeshConfig(data=-1)
  train_mesh: MeshConfig = MeshConfig(fsdp=-1)

  def __post_init__(self):
    _check_choice("config.placement.mode", self.mode, PLACEMENTS)
    _check_at_least("placement", self, 1, "rollout_devices", "train_devices")
    for name in ("rollout_mesh", "train_mesh"):
      axes = getattr(self, name).axes()
      for axis, size in axes.items():
        if size < 1 and size != -1:
          raise ConfigError(
            f"config.placement.{name}.{axis} must be >= 1, or -1 for the devices the other "
            f"axes leave, got {size}."
          )
      fill = [axis for axis, size in axes.items() if size == -1]
      if len(fill) > 1:
        raise ConfigError(
          f"config.placement.{name}: {' and '.join(fill)} are both -1; at most one axis may "
          "take the devices the others leave, give the rest sizes."
        )


PLACEMENTS = ("disaggregated", "colocated", "planned")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Generation settings.

  Attributes:
    prompts_per_step: prompts sampled per RL step.
    group_size: responses generated per prompt (G of GRPO).
    sampling: sampling parameters of every training response.
    paged: options of the paged engine.
    dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards are all equal (they
      carry no advantage) and generate more prompts until a step has `prompts_per_step`
      informative groups.
    dynamic_sampling_rounds: most generation rounds per step; if the step is still short, it
      is filled with uninformative groups (zero advantage) and the metrics say how many.
    param_dtype: dtype of the rollout engines' weights ("" = `model.param_dtype`; "auto":
      bfloat16 on accelerators, "" on CPU, `jaxrl.auto_config`): "bfloat16"
      generates from bf16 copies of a learner's fp32 master weights (half the memory and
      bandwidth per decode step); rollout log-probs then differ from the learner's by bf16
      rounding, which `train.loss.behaviour_correction` can correct.
    free_during_train: in the synchronous loop, when rollout and training share devices
      (colocated), drop the rollout workers' weights and KV page pools while the learner
      trains (the weights are stale by then; both come back at the next weight sync), so the
      learner's step has that memory.
    num_processes: processes each rollout worker (instance) spans (`loop.backend="ray"`): a
      gang of Ray actors, each holding an equal share of the worker's devices, joined into a
      JAX world of their own with one engine mesh over all their devices
      (`jaxrl/rl/ray_rollout.py`), for an instance wider than one process or host. It must
      divide the worker's devices (the rollout devices over `loop.rollout_workers`, or a
      planned instance's with `loop.ray_cluster`). 1: one process.
  """

  prompts_per_step: int = 16
  group_size: int = 8
  sampling: SamplingParams = SamplingParams()
  paged: PagedConfig = PagedConfig()
  dynamic_sampling: bool = False
  dynamic_sampling_rounds: int = 4
  param_dtype: str = ""
  free_during_train: bool = True
  num_processes: int = 1

  def __post_init__(self):
    _check_at_least("rollout", self, 1, "prompts_per_step", "dynamic_sampling_rounds")
    _check_at_least("rollout", self, 1, "num_processes")
    if self.group_size < 2:
      raise ConfigError(
        f"config.rollout.group_size must be >= 2 (advantages compare the responses to one "
        f"prompt), got {self.group_size}."
      )
    _check_choice("config.rollout.param_dtype", self.param_dtype, ("", *DTYPES))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Learner settings.

  Attributes:
    steps: RL steps (each: generate, score, update, publish weights).
    advantage: "grpo" or "drgrpo".
    updates_per_step: optimizer updates each step's batch is split into (PPO mini-batches).
    micro_batch_size: sequences per gradient-accumulation chunk; with packing, packed rows
      per micro-batch (a step's batch still splits into updates of whole micro-batches, so a
      packed update never runs more micro-batches than a padded one).
    loss: the policy loss.
    optimizer: optimizer and schedule.
    moe: MoE models: routing replay, expert placement per micro-batch, expert-parallel layer.
    precompile: compile the update for every batch shape the run can meet before it starts,
      so that no step stalls on a compilation: packed, the one shape of its rows; padded, every
      batch length (prompt + response lengths, rounded up to multiples of 8).
    compile_ahead: where `precompile` is off, compile the packed update's programs (for rows
      of `pack_length` positions) on background threads from the run's start, without running
      them, so that they compile while the first rollout runs instead of after it; the first
      update waits for them. Off: the first update compiles them (after the rollout, which,
      colocated, has freed its KV cache by then: on a GPU, XLA's autotuning of the learner's
      kernels runs on the device, beside the rollout and its memory when compiled ahead).
    pack_length: sequence packing (`jaxrl.train.packing`): positions per packed row (a
      sequence of n tokens takes n - 1). Each micro-batch is `micro_batch_size` rows of this
      many positions holding as many whole sequences as fit, so the update has one shape for
      the whole run and compiles once, and the loss is the padded batch's. -1 (the default):
      room for the longest sequence the run can meet (the longest of the task's first 1024
      prompts plus `rollout.sampling.max_new_tokens`, capped by `model.max_seq_len`); a batch
      with a longer sequence packs into longer rows, logged as a new shape. 0: no packing,
      micro-batches of sequences padded to the batch's length (a compilation per length).
    logprob_chunk: bounds the logits that exist at once when the learner computes log-probs
      and entropies (forward and backward) to about a `[micro_batch, logprob_chunk, vocab]`
      fp32 block, instead of the whole sequence's: the LM head is applied to every position
      a block of `logprob_chunk * vocab / positions` vocabulary rows at a time
      (`jaxrl.train.vocab_blocks`), so its weights are read once forward and twice backward.
    num_processes: processes the learner spans (`loop.backend="ray"`): a gang of Ray
      actors, each holding an equal share of the training mesh's devices, joined into one JAX
      world (`jaxrl/rl/ray_learner.py`), so FSDP and tensor parallelism cross processes and
      hosts. 1: one process.
  """

  steps: int = 100
  advantage: str = "grpo"
  updates_per_step: int = 1
  micro_batch_size: int = 64
  loss: LossConfig = LossConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  moe: MoEConfig = MoEConfig()
  precompile: bool = False
  compile_ahead: bool = True
  logprob_chunk: int = 128
  pack_length: int = -1
  num_processes: int = 1

  def __post_init__(self):
    _check_at_least("train", self, 0, "steps")
    _check_at_least("train", self, 1, "num_processes")
    if self.pack_length < -1:
      raise ConfigError(
        f"config.train.pack_length must be -1 (rows as long as the run's longest sequence), 0 "
        f"(no packing) or the positions of a packed row, got {self.pack_length}."
      )
    _check_at_least("train", self, 1, "updates_per_step", "micro_batch_size", "logprob_chunk")
    _check_choice("config.train.advantage", self.advantage, ADVANTAGE_MODES)


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
  """Supervised warm-up on (prompt, answer) pairs before RL starts; 0 steps skips it. The
  answer ends with the chat template's end of turn (`jaxrl.envs.end_of_turn_id`)."""

  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 1e-3

  def __post_init__(self):
    _check_at_least("warmup", self, 0, "steps", "learning_rate")
    _check_at_least("warmup", self, 1, "batch_size")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation.

  Attributes:
    every: evaluate every this many RL steps (and at the start and the end); 0 disables it.
    num_prompts: held-out prompts per evaluation.
    temperature: sampling temperature for evaluation (0 = greedy).
  """

  every: int = 10
  num_prompts: int = 128
  temperature: float = 0.0

  def __post_init__(self):
    _check_at_least("eval", self, 0, "every", "temperature")
    _check_at_least("eval", self, 1, "num_prompts")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints under `<workdir>/checkpoints`; `every` 0 saves only at the end.

  Attributes:
    every: save the run's state (weights, optimizer, data position) every this many steps.
    max_to_keep: orbax checkpoints kept.
    hf_every: a run from a Hugging Face checkpoint (`pretrained.path`) also writes its policy in
      Hub layout (config.json, safetensors, tokenizer files), which `transformers` and vLLM
      open as they are, to `<workdir>/hf/step_<N>` every this many steps and to
      `<workdir>/hf/final` at the end; 0 writes only the final one.
    hf_dtype: dtype of the exported weights.
  """

  every: int = 50
  max_to_keep: int = 2
  hf_every: int = 0
  hf_dtype: str = "bfloat16"

  def __post_init__(self):
    _check_at_least("checkpoint", self, 0, "every", "hf_every")
    _check_at_least("checkpoint", self, 1, "max_to_keep")
    _check_choice("config.checkpoint.hf_dtype", self.hf_dtype, DTYPES)


@dataclasses.dataclass(frozen=True)
class PretrainedConfig:
  """A Hugging Face checkpoint to start from (`jaxrl.model.load_pretrained`).

  Attributes:
    path: "" trains `config.model` from a random initialisation; otherwise a local directory
      or a Hub id ("Qwen/Qwen3-0.6B") with config.json, *.safetensors and tokenizer files. The
      model's shapes then come from its config.json: of `config.model` only `dtype` (compute),
      `param_dtype` (the learner's weights), `remat`, `remat_policy`, `attention`,
      `scan_layers`, `moe_dispatch` and `max_seq_len` (capped by the checkpoint's) apply.
    enable_thinking: passed to the chat template as `enable_thinking` (Qwen3: False opens the
      answer with an empty <think></think> block, for short answers); templates that do not
      read it ignore it.
  """

  path: str = ""
  enable_thinking: bool = True


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How the RL loop connects rollout and training.

  Attributes:
    mode: "sync" (generate a step's groups, then train on them), "async" (rollout workers
      generate continuously while the learner trains), or "auto" (the default): async where
      it pays, that is where rollout and training compute on hardware of their own (disjoint
      accelerator meshes, or the `ray` backend with `ray_pin_cores`), sync where they share it
      (simulated CPU devices of one process share its cores, and there async measured slower:
      docs/BENCHMARKS.md). One controller runs both (`jaxrl/rl/controller.py`): sync is the
      bound max_staleness = 0.
    max_staleness: async only: a trained token is at most this many policy versions older than
      the weights it is trained on (sync: 0).
    partial_rollouts: async only: workers switch to new weights at the next decode window and
      carry unfinished responses over; otherwise a worker finishes its running responses first.
    skew_aware_dispatch: async only: start the prompts predicted to answer longest first (from
      their earlier responses) and spread them over workers by predicted tokens.
    measured_rates: async only: split the rollout work by each worker's measured decode rate
      rather than the scheduler's prediction for its devices (for workers that share a machine
      with other work); off by default, since on this 2-core machine it lowered throughput.
    publish_on_device: async, local backend: the learner publishes each version as a copy in
      the rollout's parameter dtype kept on its own devices, which the workers copy device to
      device (for bf16 rollout of fp32 master weights: half the bytes, no trip through the
      host; it holds that copy, e.g. 1.2 GB for Qwen3-0.6B, spread over the training devices).
      False: a host copy instead (no device memory held; a device-to-host copy that the
      learner waits for at every step, and host-to-device copies for the workers).
    backend: what runs the learner, the weight store and the rollout workers: "local" (this
      process; workers are threads, each on a slice of the rollout devices) or "ray" (the
      learner one or `train.num_processes` Ray actors, each worker an actor with its own
      process and devices, the weight store an actor; needs the `ray` extra).
    ray_address: the Ray cluster to join ("" starts a local one).
    ray_cluster: a cluster spec (`configs/clusters/NAME.py`, or `PATH:ARG`) describing the Ray
      cluster's pools: the job plans the stages for it and starts the learner's processes and
      the planned rollout instances on the nodes of the pools the plan chose, with its meshes
      (each node of pool P carries the Ray resource `jaxrl-pool-P`, one unit per accelerator;
      `jaxrl/rl/ray_cluster.py`). "ray": the spec the running cluster's nodes describe (each
      node also carries `jaxrl-accelerator-<catalog key>`). "" places the actors wherever Ray
      finds room.
    learner_restarts: times a run goes on after a learner process is lost (a node gone, a
      process killed): a new learner (and workers) from the last checkpoint, the groups it
      held coming back with their tokens; then it stops with the error.
    worker_restarts: times in a run a rollout worker that crashed (an error in its engine; its
      devices are still there) is replaced by a new one on the same devices; its requests
      continue from their streamed tokens meanwhile. A worker gone without a word (a lost
      node) is replaced by re-planning (ray) instead.
    no_worker_timeout_s: how long the loop waits with no rollout worker at all (every one
      crashed, was lost or withdrawn, and none was restarted) for one to be added (re-planning
      for a changed Ray cluster, `Controller.add_worker`) before it stops with an error.
    ray_pin_cores: ray only: pin the learner's actor to the first half of this machine's CPU
      cores and the rollout workers' actors to the rest (one core each, shared round-robin
      when there are more workers than cores), so that on a CPU machine the stages compute on
      hardware of their own, as they would on separate accelerators. Each actor then has
      `placement.train_devices` or a worker's share of the rollout devices as simulated CPU
      devices.
    rollout_workers: the rollout devices are split into this many workers, each with its own
      engine on its own sub-mesh (the rollout mesh's axes but `data`, which takes the rest).
      0 (the default): one worker over all of them in sync mode (as one engine), two in async
      mode where the devices split evenly into two workers of whole engine replicas (each
      worker's devices a multiple of the rollout mesh's axes but `data`), else one.
  """

  mode: str = "auto"
  max_staleness: int = 1
  partial_rollouts: bool = True
  skew_aware_dispatch: bool = True
  measured_rates: bool = False
  publish_on_device: bool = True
  backend: str = "local"
  ray_address: str = ""
  ray_cluster: str = ""
  learner_restarts: int = 3
  worker_restarts: int = 3
  no_worker_timeout_s: float = 60.0
  ray_pin_cores: bool = False
  rollout_workers: int = 0

  def __post_init__(self):
    if self.mode not in LOOP_MODES:
      raise ConfigError(f"config.loop.mode={self.mode!r}: use one of {LOOP_MODES}.")
    if self.backend not in LOOP_BACKENDS:
      raise ConfigError(f"config.loop.backend={self.backend!r}: use one of {LOOP_BACKENDS}.")
    if self.max_staleness < 0:
      raise ConfigError(f"config.loop.max_staleness must be >= 0, got {self.max_staleness}.")
    if self.rollout_workers < 0:
      raise ConfigError(
        f"config.loop.rollout_workers must be >= 0 (0: chosen by the mode), got "
        f"{self.rollout_workers}."
      )
    _check_at_least("loop", self, 0, "learner_restarts", "worker_restarts")
    if not self.no_worker_timeout_s > 0:
      raise ConfigError(
        f"config.loop.no_worker_timeout_s must be > 0 (seconds), got {self.no_worker_timeout_s}."
      )


LOOP_MODES = ("sync", "async", "auto")
LOOP_BACKENDS = ("local", "ray")


DEFAULT_COMPILE_CACHE_DIR = "~/.cache/jaxrl/xla"


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one RL run needs.

  `tokenizer` is "char" or "byte" (the project's own), "pretrained" (the tokenizer files of
  `pretrained.path`), or a directory (or Hub id) with Hugging Face tokenizer files.

  `compile_cache_dir`: where the run's processes keep the programs XLA compiled, so that a
  rerun, a resumed run or a restarted worker with the same shapes loads them instead of
  compiling (`jaxrl/compile_cache.py`); "" compiles everything anew. A directory in
  `JAX_COMPILATION_CACHE_DIR` wins over it. Where the default cannot be written (no home
  directory, a read-only one) the run goes on without the cache, with a warning; a directory
  given here that cannot be written is an error.
  """

  seed: int = 0
  tokenizer: str = "char"
  resume: bool = False
  compile_cache_dir: str = DEFAULT_COMPILE_CACHE_DIR
  model: ModelConfig = ModelConfig()
  task: TaskConfig = TaskConfig()
  env: EnvConfig = EnvConfig()
  placement: PlacementConfig = PlacementConfig()
  rollout: RolloutConfig = RolloutConfig()
  loop: LoopConfig = LoopConfig()
  train: TrainConfig = TrainConfig()
  warmup: WarmupConfig = WarmupConfig()
  eval: EvalConfig = EvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  pretrained: PretrainedConfig = PretrainedConfig()

  def __post_init__(self):
    if self.seed < 0:
      raise ConfigError(f"config.seed must be >= 0, got {self.seed}.")
    opt, updates = self.train.optimizer, self.train.steps * self.train.updates_per_step
    if opt.schedule != "constant" and opt.total_steps < updates:
      raise ConfigError(
        f"config.train.optimizer.total_steps={opt.total_steps}: the {opt.schedule!r} schedule "
        f"reaches learning rate 0 there, before the run's {updates} updates "
        f"(config.train.steps={self.train.steps} x updates_per_step="
        f"{self.train.updates_per_step}) end; set total_steps to at least {updates}."
      )
    # The config alone decides this split; whether the training mesh's data * fsdp divides a
    # micro-batch is known once the mesh is built (`Learner.check_batch_size`).
    batch = self.rollout.prompts_per_step * self.rollout.group_size
    updates, micro = self.train.updates_per_step, self.train.micro_batch_size
    if batch % (updates * micro):
      raise ConfigError(
        f"config.train.micro_batch_size={micro}: a step's {batch} sequences "
        f"(config.rollout.prompts_per_step={self.rollout.prompts_per_step} x group_size="
        f"{self.rollout.group_size}) must split into config.train.updates_per_step={updates} "
        f"updates of whole micro-batches; make updates_per_step x micro_batch_size divide {batch}."
      )
    sampling, loss = self.rollout.sampling, self.train.loss
    corrected = loss.proximal == "recompute" and loss.behaviour_correction != "none"
    if (sampling.top_k or sampling.top_p < 1.0) and not corrected:
      raise ConfigError(
        f"config.rollout.sampling.top_k={sampling.top_k}, top_p={sampling.top_p}: responses "
        "are then sampled from a truncated distribution and carry its log-probs, while the "
        "learner scores the whole one, so the policy ratio starts below 1 and clipping drops "
        "gradients from the first update. Sample from the whole distribution (top_k=0, "
        "top_p=1.0), or correct for the truncation as for any behaviour policy: "
        "train.loss.proximal='recompute' with train.loss.behaviour_correction='truncate'."
      )
    for stage, what in (("train", "a learner"), ("rollout", "a rollout worker")):
      processes = getattr(self, stage).num_processes
      if processes > 1 and self.loop.backend != "ray":
        raise ConfigError(
          f"config.{stage}.num_processes={processes}: {what} of several processes runs on "
          f"the Ray backend; set config.loop.backend='ray' (got {self.loop.backend!r}), or "
          f"{stage}.num_processes=1."
        )


def default_config() -> ml_collections.ConfigDict:
  """Every field of `ExperimentConfig` with its default, as a ConfigDict to edit."""
  return ml_collections.ConfigDict(dataclasses.asdict(ExperimentConfig()))


def model_config(preset: str, **overrides) -> ml_collections.ConfigDict:
  """A model preset as a ConfigDict, for `config.model = model_config("tiny")`."""
  return ml_collections.ConfigDict(dataclasses.asdict(get_preset(preset, **overrides)))


def load_config(
  path: str, arg: str | None = None, overrides: Mapping[str, Any] | None = None
) -> ExperimentConfig:
  """`get_config(arg)` of a config file, with dotted-key overrides ("rollout.group_size": 4)
  applied before conversion: what `--config path:arg --config.a.b=v` does, for code."""
  spec = importlib.util.spec_from_file_location(os.path.basename(path).removesuffix(".py"), path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cd = module.get_config(arg)
  for key, value in (overrides or {}).items():
    node = cd
    *parents, leaf = key.split(".")
    try:
      for parent in parents:
        node = node[parent]
      node[leaf] = value
    except (KeyError, TypeError, AttributeError) as e:
      raise ConfigError(f"config.{key}={value!r}: cannot override: {e}") from None
  return from_config_dict(cd)


def from_config_dict(
  config: Mapping[str, Any] | ml_collections.ConfigDict,
  backend: str | None = None,
  compute_capability: str | None = None,
) -> ExperimentConfig:
  """Converts a ConfigDict into `ExperimentConfig`, checking every key and type.

  `"auto"` settings (`model.dtype`, `rollout.param_dtype`, `model.attention`,
  `model.moe_dispatch`) follow
  `backend` and a GPU's `compute_capability` (default: JAX's default device's;
  `jaxrl.auto_config`)."""
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  config = resolve_auto(dict(config), backend, compute_capability)
  return _build(ExperimentConfig, config, "config")


def _build(cls, values: Mapping[str, Any], path: str):
  if not isinstance(values, Mapping):
    raise ConfigError(
      f"{path}: expected a mapping of fields of {cls.__name__}, got "
      f"{type(values).__name__} {values!r}."
    )
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(
      f"{path}.{unknown[0]}: unknown key; {cls.__name__} has the keys {sorted(fields)}."
    )
  kwargs = {name: _convert(hints[name], value, f"{path}.{name}") for name, value in values.items()}
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"{path}: {e}") from e


def _convert(hint, value, path: str):
  if dataclasses.is_dataclass(hint):
    return _build(hint, value, path)
  origin = typing.get_origin(hint)
  if origin is tuple:
    item = typing.get_args(hint)[0]
    if not isinstance(value, list | tuple):
      raise ConfigError(f"{path}: expected a tuple of {item.__name__}, got {value!r}.")
    return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
  if origin is collections.abc.Mapping:
    if not isinstance(value, Mapping):
      raise ConfigError(f"{path}: expected a dict, got {type(value).__name__} {value!r}.")
    return dict(value)
  if origin in (typing.Union, types.UnionType):
    raise ConfigError(f"{path}: union-typed config fields are not supported.")
  ok = {
    bool: isinstance(value, bool),
    int: isinstance(value, int) and not isinstance(value, bool),
    float: isinstance(value, int | float) and not isinstance(value, bool),
    str: isinstance(value, str),
  }.get(hint)
  if ok is None:
    raise ConfigError(f"{path}: unsupported field type {hint!r}.")
  if not ok:
    raise ConfigError(f"{path}: expected {hint.__name__}, got {type(value).__name__} {value!r}.")
  if hint is float and not math.isfinite(value):  # NaN passes every `value < minimum` check
    raise ConfigError(f"{path}: expected a finite number, got {value!r}.")
  return float(value) if hint is float else value
