"""Helpers shared by tests: tiny Hugging Face checkpoints and tokenizers written on the spot,
the fp32 tolerance rule (`tolerance`), and kernels lowered for CUDA (`lowering`)."""
