"""Causal grouped-query attention for training and prefill, with segment ids for packed rows
and positions for chunks after cached keys: blockwise jnp reference, Pallas TPU and GPU
kernels, forward and backward."""

from jaxrl.kernels.common import IMPLS
from jaxrl.kernels.flash_attention.api import BlockSizes, flash_attention

__all__ = ["IMPLS", "BlockSizes", "flash_attention"]
