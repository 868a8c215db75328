"""Pallas kernels, each with a pure-jnp reference (installed as `jaxrl.kernels`)."""

from jaxrl.kernels.paged_attention import paged_attention as paged_attention
