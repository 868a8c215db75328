"""jaxrl: RL post-training of LLMs in JAX, with rollout and training on disaggregated meshes."""

__version__ = "0.1.0"
