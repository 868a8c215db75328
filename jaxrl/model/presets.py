"""Named model shapes: the tiny ones the tests and demos train, and real checkpoints' shapes
(the scheduler plans with them; `load_pretrained` reads the weights)."""

from __future__ import annotations

import dataclasses

from jaxrl.model.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
  # Small enough to train to competence on a 2-core CPU in minutes (tests and the demo).
  "tiny": ModelConfig(),
  "tiny-moe": ModelConfig(num_experts=8, experts_per_token=2, moe_mlp_dim=128),
  # Device work negligible beside the host's: the rollout bench's host-overhead workload.
  "micro": ModelConfig(
    vocab_size=256,
    d_model=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    mlp_dim=128,
    max_seq_len=1024,
  ),
  "bench-tiny": ModelConfig(
    vocab_size=1024,
    d_model=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    mlp_dim=1024,
    max_seq_len=1024,
  ),
  "bench-small": ModelConfig(
    vocab_size=32768,
    d_model=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    mlp_dim=2048,
    max_seq_len=2048,
  ),
  "qwen3-0.6b": ModelConfig(
    vocab_size=151936,
    d_model=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=3072,
    max_seq_len=40960,
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_embeddings=True,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
  # Gemma 3 1B's shapes (google/gemma-3-1b-it): local layers with a 512-position window and
  # base 10,000, every sixth layer global; for benchmarks of windowed attention.
  "gemma3-1b": ModelConfig(
    vocab_size=262144,
    d_model=1152,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    mlp_dim=6912,
    max_seq_len=32768,
    rope_theta=1_000_000.0,
    qk_norm=True,
    norm_position="sandwich",
    norm_scale_plus_one=True,
    mlp_activation="gelu_tanh",
    scale_embeddings=True,
    sliding_window=512,
    sliding_layers=tuple(i for i in range(26) if (i + 1) % 6),
    local_rope_theta=10_000.0,
    tie_embeddings=True,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
  # Shapes only (the scheduler plans with them; nothing here downloads or runs them).
  "qwen3-8b": ModelConfig(
    vocab_size=151936,
    d_model=4096,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=12288,
    max_seq_len=40960,
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_embeddings=False,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
  "qwen3-32b": ModelConfig(
    vocab_size=151936,
    d_model=5120,
    num_layers=64,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=25600,
    max_seq_len=40960,
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_embeddings=False,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
  "qwen3-30b-a3b": ModelConfig(
    vocab_size=151936,
    d_model=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    mlp_dim=6144,
    num_experts=128,
    experts_per_token=8,
    moe_mlp_dim=768,
    max_seq_len=40960,
    rope_theta=1_000_000.0,
    qk_norm=True,
    tie_embeddings=False,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
  # openai/gpt-oss-20b (21B parameters, 3.6B active): attention sinks, every other layer
  # windowed, MoE with biases and the clamped SwiGLU, YaRN to 128k.
  "gpt-oss-20b": ModelConfig(
    vocab_size=201088,
    d_model=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    mlp_dim=2880,
    num_experts=32,
    experts_per_token=4,
    moe_mlp_dim=2880,
    moe_biases=True,
    mlp_activation="clamped_swiglu",
    max_seq_len=131072,
    rope_theta=150_000.0,
    rope_scaling="yarn",
    rope_factor=32.0,
    rope_original_max_position_embeddings=4096,
    rope_truncate=False,
    norm_eps=1e-5,
    qkv_bias=True,
    attention_out_bias=True,
    attention_sinks=True,
    sliding_window=128,
    sliding_layers=tuple(range(0, 24, 2)),
    tie_embeddings=False,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, with fields replaced by `overrides`."""
  if name not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; known presets: {sorted(PRESETS)}.")
  return dataclasses.replace(PRESETS[name], **overrides)
