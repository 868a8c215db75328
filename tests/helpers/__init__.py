"""Helpers shared by tests: tiny Hugging Face checkpoints and tokenizers written on the spot,
the fp32 tolerance rule (`tolerance`), kernels lowered for CUDA (`lowering`), packed rows
(`packed_rows`), and which device arrays a block reads whole onto the host (`host_reads`)."""
