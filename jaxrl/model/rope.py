"""Rotary position embeddings (RoPE) and the context-extension scalings checkpoints declare.

Frequencies are computed on the host in float32 the way transformers computes them
(`modeling_rope_utils`), so that logits match its checkpoints' to float32 rounding. The scalings
(`ModelConfig.rope_scaling`):
  "": plain RoPE, inverse frequencies `theta ** (-2i / head_dim)`.
  "llama3" (Llama 3.1): wavelengths longer than the pretraining context / low_freq_factor are
    stretched by `rope_factor`, those shorter than it / high_freq_factor kept, a linear blend
    in 1 / wavelength between.
  "linear" (position interpolation): every frequency divided by `rope_factor`.
  "yarn" (YaRN, Peng et al. 2023; Qwen2.5 and Qwen3 extend to 128k with it): dimensions that
    turn fewer than `rope_beta_slow` times over the pretraining context are interpolated
    (divided by `rope_factor`), those turning more than `rope_beta_fast` times kept, a linear
    ramp over dimension index between; and cos and sin are multiplied by an attention factor
    (default `0.1 ln(factor) + 1`), which scales every attention logit by its square. The
    scaling is static: the same at every length, as in transformers and vLLM.
  "longrope" (LongRoPE, Ding et al. 2024; Phi-3.5, Phi-4-mini): frequency i divided by
    `rope_short_factor[i]` at positions before `rope_original_max_position_embeddings` and by
    `rope_long_factor[i]` from there on, cos and sin times an attention factor (default
    `sqrt(1 + ln(factor) / ln(original))`). The choice is per position, so a token's rotation
    never changes once its keys are cached and the rollout and the learner agree on it.
    Within the original context this is transformers' and vLLM's rotation. Past it they
    differ: transformers rotates every position of a longer sequence with the long factors
    (its Phi-3 `generate` drops the cache when the sequence first passes the original
    context and recomputes it so), and vLLM takes the long ones for a whole batch once any
    of its positions passes it, without recomputing cached keys. jaxrl's logits equal
    transformers' model stepped token by token with its cache.
With a `ModelConfig.rotary_dim` below the head's width (Phi-4-mini), the frequencies have the
exponent of that width and only `rotary_dim // 2` pairs rotate: the others get frequency 0,
the identity, in jaxrl's layout of the heads (`partial_rotary_order`).
Layers listed in `ModelConfig.nope_layers` are not rotated at all (NoPE, SmolLM3). With a
`ModelConfig.local_rope_theta`, the sliding-window layers rotate with plain RoPE of that base
(Gemma 3) and the scaling applies to the others only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model.config import ModelConfig


def yarn_default_attention_factor(
  factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
  """YaRN's attention factor when a checkpoint gives none: `0.1 ln(factor) + 1`, or with
  DeepSeek's `mscale` and `mscale_all_dim` the ratio of that formula at the two scales."""

  def get(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if mscale and mscale_all_dim:
    return float(get(factor, mscale) / get(factor, mscale_all_dim))
  return get(factor)


def rope_attention_factor(cfg: ModelConfig) -> float:
  """What cos and sin are multiplied by: 1 except under YaRN and LongRoPE."""
  if cfg.rope_scaling == "longrope":
    if cfg.rope_attention_factor or cfg.rope_factor <= 1:
      return cfg.rope_attention_factor or 1.0
    original = cfg.rope_original_max_position_embeddings
    return math.sqrt(1 + math.log(cfg.rope_factor) / math.log(original))
  if cfg.rope_scaling != "yarn":
    return 1.0
  return cfg.rope_attention_factor or yarn_default_attention_factor(cfg.rope_factor)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray | None:
  """jaxrl's order of a query or key head's dimensions under partial rotary embeddings
  (`ModelConfig.rotary_dim`): ours[..., j] = checkpoint's[..., order[j]]. A checkpoint rotates
  pairs `(i, i + r / 2)` of its first r dimensions and leaves the rest; reordered, those pairs
  sit at `(i, i + head_dim / 2)` for i < r / 2, the pairs of whole-head RoPE, and the unrotated
  dimensions fill the two halves' ends, paired among themselves at frequency 0. Attention
  logits are sums over the dimensions of q and k reordered alike: the same values. None where
  the whole head rotates."""
  if rotary_dim in (0, head_dim):
    return None
  half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
  first = np.concatenate([np.arange(half), rotary_dim + np.arange(rest)])
  second = np.concatenate([half + np.arange(half), rotary_dim + rest + np.arange(rest)])
  return np.concatenate([first, second])


def _yarn(powers: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """`powers` is `theta ** (2i / dim)`, float32 (the plain wavelengths over 2 pi), `dim` the
  rotated width (`rotary_dim`, or the head's)."""
  dim, base = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta
  old_len = cfg.rope_original_max_position_embeddings

  def dim_turning(turns: float) -> float:  # the dimension that turns `turns` times in old_len
    return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

  low, high = dim_turning(cfg.rope_beta_fast), dim_turning(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  kept = 1 - ramp.astype(np.float32)  # 1: the plain frequency (extrapolated), 0: interpolated
  interpolated = np.float32(1.0) / (np.float32(cfg.rope_factor) * powers)
  return interpolated * (1 - kept) + (np.float32(1.0) / powers) * kept


def _llama3(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  factor, old_len = cfg.rope_factor, cfg.rope_original_max_position_embeddings
  low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths (beyond the pretraining context / low) are stretched by `factor`, short ones
  # (below context / high) kept, and the band between blends the two linearly in 1 / wavelength.
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, blended, scaled)


@functools.lru_cache(maxsize=64)
def rope_inv_freq(cfg: ModelConfig, *, long: bool = False) -> np.ndarray:
  """The inverse frequencies of RoPE, float32 `[head_dim // 2]`, with `cfg`'s scaling (under
  longrope: its short factors, or with `long` its long ones); 0 for the pairs a partial
  rotation (`rotary_dim`) leaves."""
  dim = cfg.rotary_dim or cfg.head_dim
  powers = np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2).astype(np.float32) / dim)
  inv_freq = np.float32(1.0) / powers
  if cfg.rope_scaling == "llama3":
    inv_freq = _llama3(inv_freq, cfg)
  elif cfg.rope_scaling == "linear":
    inv_freq = inv_freq / np.float32(cfg.rope_factor)
  elif cfg.rope_scaling == "yarn":
    inv_freq = _yarn(powers, cfg)
  elif cfg.rope_scaling == "longrope":
    factors = cfg.rope_long_factor if long else cfg.rope_short_factor
    inv_freq = np.float32(1.0) / (np.asarray(factors, np.float32) * powers)
  inv_freq = np.pad(inv_freq.astype(np.float32), (0, (cfg.head_dim - dim) // 2))
  return inv_freq.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _local_rope(cfg: ModelConfig) -> ModelConfig:
  """The RoPE of `cfg`'s sliding-window layers: plain, with base `local_rope_theta`."""
  return dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling="")


def rope_cos_sin(
  positions_bt: jax.Array, cfg: ModelConfig, layer: int | jax.Array = 0, *, local: bool = False
) -> tuple[jax.Array, jax.Array]:
  """Cosines and sines of the rotary angles, float32 `[b, t, head_dim // 2]` each, times the
  scaling's attention factor (1 except under YaRN). In a layer of `cfg.nope_layers` (`layer`
  may be traced: a scanned stack's index) they are 1 and 0, the identity rotation, which
  leaves q and k exactly as they are. `local`: a sliding-window layer (static), which takes
  `cfg.local_rope_theta` where that is set."""
  if local and cfg.local_rope_theta:
    cfg = _local_rope(cfg)
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  if cfg.rope_scaling == "longrope":  # the long factors from the original context on
    extended = positions_bt[..., None] >= cfg.rope_original_max_position_embeddings
    inv_freq = jnp.where(extended, jnp.asarray(rope_inv_freq(cfg, long=True)), inv_freq)
  angles_btf = positions_bt[..., None].astype(jnp.float32) * inv_freq
  scale = rope_attention_factor(cfg)
  cos, sin = jnp.cos(angles_btf), jnp.sin(angles_btf)
  if scale != 1.0:  # on the rotated pairs: a partial rotation's others pass as they are
    rotated = (cfg.rotary_dim or cfg.head_dim) // 2
    scale_f = jnp.where(jnp.arange(cfg.head_dim // 2) < rotated, jnp.float32(scale), 1.0)
    cos, sin = cos * scale_f, sin * scale_f
  if not cfg.nope_layers:
    return cos, sin
  if isinstance(layer, int):
    return (jnp.ones_like(cos), jnp.zeros_like(sin)) if layer in cfg.nope_layers else (cos, sin)
  rotates = jnp.asarray([i not in cfg.nope_layers for i in range(cfg.num_layers)])[layer]
  return jnp.where(rotates, cos, 1.0), jnp.where(rotates, sin, 0.0)
