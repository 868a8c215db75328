"""Decoder-only transformer (dense and MoE) in Flax NNX, its configs, and a pure-function view."""

from jaxrl.model.cache import LayerCache, PagedLayerCache, init_cache
from jaxrl.model.config import PRESETS, ModelConfig, get_preset
from jaxrl.model.functional import Model, Params
from jaxrl.model.moe import ExpertParallel, MoEInputs, MoEMLP, replay_route, route
from jaxrl.model.transformer import Transformer

__all__ = [
  "PRESETS",
  "ExpertParallel",
  "LayerCache",
  "PagedLayerCache",
  "Model",
  "ModelConfig",
  "MoEInputs",
  "MoEMLP",
  "Params",
  "Transformer",
  "get_preset",
  "init_cache",
  "replay_route",
  "route",
]
