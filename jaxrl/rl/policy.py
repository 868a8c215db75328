"""The policy a job trains: its tokenizer, model config, first weights, rollout engines and
Hugging Face export.

A job starts either from `config.model` (a preset, randomly initialised, with the project's
char/byte tokenizers) or from a Hugging Face checkpoint (`config.pretrained.path`): then the
shapes come from its config.json, the tokenizer and chat template from its files, the first
weights from its safetensors (each parameter read straight into the training mesh's sharding),
and the trained policy goes back out in the same layout. Every stage (the learner, local and
Ray rollout workers) builds its model, tokenizer and rollout engine here, so they cannot
disagree.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Literal

import jax

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.hf_tokenizer import TokenizerError, load_tokenizer
from jaxrl.data.tokenizer import TOKENIZERS, Tokenizer
from jaxrl.hub import PretrainedNotFound, resolve_pretrained
from jaxrl.model import Model, ModelConfig, Params
from jaxrl.model.hf import load_pretrained, save_pretrained
from jaxrl.model.hf_config import config_from_hf
from jaxrl.model.safetensors_io import CheckpointError
from jaxrl.rollout import PagedEngine, SamplingParams
from jaxrl.sharding import STAGE_RULES, make_mesh

log = logging.getLogger(__name__)


def pretrained_dir(cfg: ExperimentConfig) -> str | None:
  """The local directory of `config.pretrained.path` (a Hub id is fetched once), or None."""
  if not cfg.pretrained.path:
    return None
  try:
    return resolve_pretrained(cfg.pretrained.path)
  except PretrainedNotFound as e:
    raise ConfigError(f"config.pretrained.path: {e}") from None


def make_tokenizer(cfg: ExperimentConfig) -> Tokenizer:
  """The tokenizer `config.tokenizer` names (see `ExperimentConfig`)."""
  name = cfg.tokenizer
  if name in TOKENIZERS:
    return TOKENIZERS[name]()
  if name == "pretrained":
    if not cfg.pretrained.path:
      raise ConfigError(
        "config.tokenizer='pretrained' reads the tokenizer of config.pretrained.path, which is "
        "empty; set it, or choose config.tokenizer from "
        f"{sorted(TOKENIZERS)} or a tokenizer directory."
      )
    path, key = pretrained_dir(cfg), "config.tokenizer='pretrained' (config.pretrained.path)"
  else:
    path, key = name, "config.tokenizer"
  try:
    return load_tokenizer(path)
  except (TokenizerError, PretrainedNotFound) as e:
    raise ConfigError(
      f"{key}: {e} (config.tokenizer is one of {sorted(TOKENIZERS)}, 'pretrained', or a "
      "directory of Hugging Face tokenizer files)."
    ) from None


def model_config(cfg: ExperimentConfig, tokenizer: Tokenizer) -> ModelConfig:
  """The learner's model: `config.model`, or the checkpoint's shapes with `config.model`'s
  dtypes, remat (and its policy), attention, layer scan and length limit; ids past the tokenizer's
  vocabulary masked out."""
  source = pretrained_dir(cfg)
  if source is None:
    model = cfg.model
    if tokenizer.vocab_size > model.vocab_size:
      raise ConfigError(
        f"config.model.vocab_size={model.vocab_size} is smaller than the {cfg.tokenizer!r} "
        f"tokenizer's {tokenizer.vocab_size} ids; raise config.model.vocab_size."
      )
  else:
    config_path = os.path.join(source, "config.json")
    try:
      with open(config_path, encoding="utf-8") as f:
        hf = json.load(f)
      model = config_from_hf(hf)
    except (OSError, json.JSONDecodeError, CheckpointError, ValueError) as e:
      raise ConfigError(f"config.pretrained.path: {config_path}: {e}") from None
    model = dataclasses.replace(
      model,
      dtype=cfg.model.dtype,
      param_dtype=cfg.model.param_dtype,
      remat=cfg.model.remat,
      remat_policy=cfg.model.remat_policy,
      attention=cfg.model.attention,
      scan_layers=cfg.model.scan_layers,
      moe_dispatch=cfg.model.moe_dispatch,
      max_seq_len=min(model.max_seq_len, cfg.model.max_seq_len),
    )
    if tokenizer.vocab_size > model.vocab_size:
      raise ConfigError(
        f"config.tokenizer: the tokenizer has {tokenizer.vocab_size} ids but the checkpoint "
        f"{config_path} embeds only {model.vocab_size}; use the checkpoint's own tokenizer "
        "(config.tokenizer='pretrained')."
      )
  limit = tokenizer.vocab_size if tokenizer.vocab_size < model.vocab_size else 0
  return dataclasses.replace(model, vocab_limit=limit)


def rollout_model_config(cfg: ExperimentConfig, model: ModelConfig) -> ModelConfig:
  """The rollout engines' model: the learner's in `config.rollout.param_dtype`, if set."""
  dtype = cfg.rollout.param_dtype  # checked when the config is converted
  return dataclasses.replace(model, param_dtype=dtype) if dtype else model


def rollout_worker_mesh(devices, rollout_axes: dict[str, int]) -> jax.sharding.Mesh:
  """A rollout worker's mesh over its `devices`: the rollout mesh's axes (`rollout_axes`, e.g.
  tensor or expert parallelism) but for `data`, which takes the rest. Local and Ray workers
  both build theirs here: a worker that dropped the other axes would, for a MoE model, lose
  its expert parallelism without a word."""
  shape = {k: v for k, v in rollout_axes.items() if k != "data"}
  try:
    return make_mesh(devices, {**shape, "data": -1})
  except ValueError as e:
    raise ConfigError(
      f"config.loop.rollout_workers: a worker of {len(devices)} devices: {e}"
    ) from None


def make_rollout_engine(
  cfg: ExperimentConfig, model: Model, mesh: jax.sharding.Mesh, tokenizer: Tokenizer, rollout=None
):
  """The paged rollout engine over `mesh` (`rollout`: the `RolloutConfig` to use, default
  `cfg.rollout`). The RL loop streams, moves and preempts requests, which only the paged engine
  can; the static engine (`rollout.StaticEngine`) is the benchmarks' baseline."""
  rollout = rollout or cfg.rollout
  paged = rollout.paged
  if not cfg.env.name:  # single-turn: no request keeps its pages, so precompile skips that case
    paged = dataclasses.replace(paged, keep_turn_kv=False)
  return PagedEngine(
    model,
    mesh,
    STAGE_RULES["rollout"],
    eos_id=tokenizer.eos_id,
    pad_id=tokenizer.pad_id,
    config=paged,
  )


def initial_params(cfg: ExperimentConfig, model: Model, mesh: jax.sharding.Mesh) -> Params | None:
  """The checkpoint's weights on `mesh` in the training layout (None: initialise randomly)."""
  source = pretrained_dir(cfg)
  if source is None:
    return None
  try:
    loaded, params = load_pretrained(
      source, dtype=model.config.param_dtype, mesh=mesh, rules=STAGE_RULES["train"]
    )
  except CheckpointError as e:
    raise ConfigError(f"config.pretrained.path: {e}") from None
  shapes = jax.tree.map(lambda a: (a.shape, a.dtype), model.abstract_params())
  if jax.tree.map(lambda a: (a.shape, a.dtype), loaded.abstract_params()) != shapes:
    raise ConfigError(
      f"config.pretrained.path: {source} loads parameters unlike the model built from its "
      "config.json; this is a bug, please report it."
    )
  return params


def tokenizer_files_dir(cfg: ExperimentConfig) -> str | Literal[False]:
  """Where the run's tokenizer files are (`config.tokenizer`): the checkpoint's for
  "pretrained", the named directory, or False for jaxrl's own ("char", "byte": no files)."""
  if cfg.tokenizer in TOKENIZERS:
    return False
  if cfg.tokenizer == "pretrained":
    return pretrained_dir(cfg) or False
  return resolve_pretrained(cfg.tokenizer)


def export_policy(cfg: ExperimentConfig, model: Model, params: Params, out_dir: str) -> str:
  """Writes the policy in Hugging Face layout to `out_dir` (configs copied from the checkpoint
  it started from, the tokenizer files of the run's tokenizer); returns `out_dir`."""
  save_pretrained(
    model,
    params,
    out_dir,
    source=pretrained_dir(cfg),
    dtype=cfg.checkpoint.hf_dtype,
    tokenizer_source=tokenizer_files_dir(cfg),
  )
  log.info("policy written in Hugging Face format to %s", out_dir)
  return out_dir


def training_sampling(cfg: ExperimentConfig, tokenizer: Tokenizer) -> SamplingParams:
  """The sampling of every training response: `config.rollout.sampling`, with the tokenizer's
  stop ids (end of turn, end of text) added to the config's own."""
  stops = tuple(dict.fromkeys((*cfg.rollout.sampling.stop_token_ids, *tokenizer.stop_ids)))
  return dataclasses.replace(cfg.rollout.sampling, stop_token_ids=stops)


def template_kwargs(cfg: ExperimentConfig) -> dict[str, bool]:
  """Chat-template variables of every prompt of the run."""
  return {"enable_thinking": cfg.pretrained.enable_thinking}


class PolicyExporter:
  """Writes the policy in Hugging Face layout to `<workdir>/hf/step_<N>` every
  `checkpoint.hf_every` steps and to `<workdir>/hf/final` at the end of the run."""

  def __init__(self, cfg: ExperimentConfig, model: Model, workdir: str):
    self.cfg = cfg
    self.model = model
    self.root = os.path.join(workdir, "hf")
    if tokenizer_files_dir(cfg) is False:
      log.warning(
        "config.tokenizer=%r is jaxrl's own, with no Hugging Face files: the policy exported "
        "to %s will have no tokenizer.",
        cfg.tokenizer,
        self.root,
      )

  def due(self, step: int, last: bool) -> str | None:
    """The directory to export to after `step` (`last`: the run's end), or None if not due:
    asked before the weights are fetched, which for a remote learner is a full transfer."""
    every = self.cfg.checkpoint.hf_every
    if last:
      return os.path.join(self.root, "final")
    if every and step % every == 0:
      return os.path.join(self.root, f"step_{step:06d}")
    return None

  def export(self, params: Params, out_dir: str) -> str:
    """Writes `params` to `out_dir` (from `due`)."""
    return export_policy(self.cfg, self.model, params, out_dir)
