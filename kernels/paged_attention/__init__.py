"""Decode attention over a paged KV cache: pure-jnp reference, Pallas TPU and GPU kernels."""

from jaxrl.kernels.common import IMPLS
from jaxrl.kernels.paged_attention.api import BlockSizes, default_block_sizes, paged_attention

__all__ = ["IMPLS", "BlockSizes", "default_block_sizes", "paged_attention"]
