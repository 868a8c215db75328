"""Pallas kernels, each with a pure-jnp reference (installed as `jaxrl.kernels`)."""

from jaxrl.kernels.gmm import gmm as gmm
from jaxrl.kernels.gmm import tgmm as tgmm
from jaxrl.kernels.paged_attention import paged_attention as paged_attention
from jaxrl.kernels.partitioning import KernelMesh as KernelMesh
from jaxrl.kernels.qk_rope_write import qk_rope_write as qk_rope_write
