"""Causal grouped-query attention for training and prefill, with segment ids for packed rows,
positions for chunks after cached keys, an optional sliding window and an optional logit
softcap: blockwise jnp reference, Pallas TPU and GPU kernels, forward and backward; and
cuDNN's fused attention behind the same rule (without a window or a cap)."""

from jaxrl.kernels.common import IMPLS
from jaxrl.kernels.flash_attention.api import (
  FLASH_IMPLS,
  FLASH_RESIDUAL_NAMES,
  BlockSizes,
  flash_attention,
  save_attention_policy,
)
from jaxrl.kernels.flash_attention.cudnn import DEFAULT_MAX_SEGMENTS as CUDNN_MAX_SEGMENTS

__all__ = [
  "CUDNN_MAX_SEGMENTS",
  "FLASH_IMPLS",
  "FLASH_RESIDUAL_NAMES",
  "IMPLS",
  "BlockSizes",
  "flash_attention",
  "save_attention_policy",
]
