"""Helpers shared by tests: tiny Hugging Face checkpoints and tokenizers written on the spot,
and the fp32 tolerance rule (`tolerance`)."""
