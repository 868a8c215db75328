"""Causal grouped-query attention for training and prefill, with segment ids for packed rows
and positions for chunks after cached keys: blockwise jnp reference, Pallas TPU and GPU
kernels, forward and backward."""

from jaxrl.kernels.common import IMPLS
from jaxrl.kernels.flash_attention.api import FLASH_RESIDUAL_NAMES, BlockSizes, flash_attention

__all__ = ["FLASH_RESIDUAL_NAMES", "IMPLS", "BlockSizes", "flash_attention"]
