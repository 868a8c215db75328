"""Pallas kernels, each with a pure-jnp reference (installed as `jaxrl.kernels`)."""
