"""Helpers shared by tests: tiny Hugging Face checkpoints and tokenizers written on the spot."""
