"""Grouped matmuls (MoE expert layers): pure-jnp reference, Pallas TPU and GPU kernels."""

from jaxrl.kernels.common import IMPLS
from jaxrl.kernels.gmm.api import BlockSizes, gmm, tgmm

__all__ = ["IMPLS", "BlockSizes", "gmm", "tgmm"]
