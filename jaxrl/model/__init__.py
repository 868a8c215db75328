"""Decoder-only transformer (dense and MoE) in Flax NNX, its configs, a pure-function view, and
Hugging Face checkpoints in and out."""

from jaxrl.model.cache import LayerCache, PackedPrefillCache, PagedLayerCache, init_cache
from jaxrl.model.config import ModelConfig
from jaxrl.model.functional import Model, Params, cast_params, copy_params
from jaxrl.model.hf import load_pretrained, save_pretrained
from jaxrl.model.hf_config import config_from_hf, config_to_hf
from jaxrl.model.moe import ExpertParallel, MoEInputs, MoEMLP, replay_route, route
from jaxrl.model.presets import PRESETS, get_preset
from jaxrl.model.safetensors_io import CheckpointError
from jaxrl.model.transformer import LMHead, Transformer

__all__ = [
  "PRESETS",
  "CheckpointError",
  "ExpertParallel",
  "LMHead",
  "LayerCache",
  "PackedPrefillCache",
  "PagedLayerCache",
  "Model",
  "ModelConfig",
  "MoEInputs",
  "MoEMLP",
  "Params",
  "Transformer",
  "cast_params",
  "config_from_hf",
  "config_to_hf",
  "copy_params",
  "get_preset",
  "init_cache",
  "load_pretrained",
  "replay_route",
  "route",
  "save_pretrained",
]
