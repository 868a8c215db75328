"""Tiny random Hugging Face checkpoints, written on the spot with transformers (no Hub access).

`write_checkpoint(directory, arch, tied=...)` builds a small random transformers model of one of
the architectures jaxrl reads (vocab 512, width 64, 2 layers, grouped-query attention) and saves
it the way the Hub holds it: config.json, model.safetensors (or shards and an index),
generation_config.json, and optionally a tokenizer from `helpers.hf_tokenizers`. Weights are
drawn larger than transformers' initialisation (which leaves every layer close to identity), so
that attention, RoPE and routing visibly shape the logits and a wrong conversion fails a test.

Architectures (`ARCHS`) and what each exercises:
  "llama": Llama 3.1 RoPE scaling (llama3, original context 64 so it acts within 256 tokens),
    head_dim 32 != hidden / heads.
  "mistral": a sliding window of 48 positions in every layer (shorter than the tests'
    sequences), head_dim from hidden / heads, rope_theta 1e6.
  "qwen2": q/k/v biases, rope_theta 1e6.
  "qwen3": q/k RMSNorm, head_dim 24, rope_theta 1e6.
  "qwen3_moe": 8 experts, top-2, q/k norm; `norm_topk_prob` as given (default True).
  "qwen2_moe": 8 experts of width 32, top-2 without renormalisation (its default), a shared
    expert of width 48 behind a sigmoid gate, q/k/v biases.
  "smollm3": the second layer without RoPE (NoPE), rope_theta 1e4 (its default, 2e6, would
    barely turn within the tests' sequences).
  "olmo2": norms after each sublayer, q/k norms across heads, rope_theta 5e5, eps 1e-5.
  "exaone4": OLMo 2's post-norms with per-head q/k norms (Qwen3's), the first layer sliding
    (window 48) and the second global without RoPE, as EXAONE 4's hybrid models have them.
  "olmo3": OLMo 2's network with the first layer sliding (window 48), YaRN (factor 4,
    original context 64) in the full layer only, plain RoPE at the same base (1e4) in the
    sliding one (transformers 5's `rope_parameters` per layer type).
  "phi3": q/k/v fused in qkv_proj, gate/up in gate_up_proj, eps 1e-5.
  "mixtral": 8 experts of width 32 (its intermediate_size), top-2 renormalised, no q/k norms,
    its own tensor names (block_sparse_moe, w1/w2/w3), rope_theta 1e4.
  "olmoe": 8 experts of width 32 (its intermediate_size), top-2 without renormalisation
    (transformers' default), q/k norms across heads.
  "gemma3_text": 5 layers, sliding (window 48) but for the third; sandwich norms stored minus
    one, q/k norms, GeGLU, scaled embeddings, query_pre_attn_scalar 24 (head_dim 16), linear
    RoPE scaling (factor 2, base 1e4) in full layers and base 1e3 in sliding ones.
  "gemma2": 3 layers, the first and third sliding (window 48, transformers' default
    alternation); Gemma 3's norms, GeGLU and embedding scale without q/k norms; attention
    logits softcapped at 2 and final logits at 5 (Gemma 2's 50 and 30 would leave a tiny
    model's logits uncapped), query_pre_attn_scalar 24 (head_dim 16).
  "ernie4_5": Llama's network with the whole head rotated in interleaved pairs, head_dim 32,
    rope_theta 1e4.
  "glm4": sandwich norms with plain scales, q/k/v biases, gate/up fused, the first half of
    each head (head_dim 32) rotated in interleaved pairs, rope_theta 1e4.
  "seed_oss": Qwen2's network (q/k/v biases) with head_dim 32 != hidden / heads, and the
    attention and residual dropout of 0.1 its checkpoints declare (transformers applies it in
    training only).
  "granite": Llama's network with embeddings times 4, sublayer outputs times 0.5, attention
    logits times 0.1 (head_dim 16: not 16 ** -0.5) and logits divided by 3.
  "granitemoe": Granite's multipliers on Mixtral's network: 8 experts of width 32 stacked in
    input_linear / output_linear, top-2 renormalised.
  "gpt_oss": 8 experts of width 32, top-2, router and expert biases, the clamped SwiGLU at a
    limit of 1.5 (gpt-oss's 7 would rarely bind in a tiny model), attention biases and sinks,
    the first layer sliding (window 48), YaRN (factor 4, original context 64, untruncated).

Also the config.json of Qwen3-0.6B, Qwen3-30B-A3B and Llama-3.2-1B as the Hub publishes them
(`QWEN3_0_6B`, `QWEN3_30B_A3B`, `LLAMA_3_2_1B`), for tests of configs without weights.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers

ARCHS = (
  "llama",
  "mistral",
  "qwen2",
  "qwen3",
  "qwen3_moe",
  "qwen2_moe",
  "smollm3",
  "olmo2",
  "olmo3",
  "exaone4",
  "olmoe",
  "phi3",
  "mixtral",
  "gemma3_text",
  "gemma2",
  "granite",
  "seed_oss",
  "glm4",
  "ernie4_5",
  "granitemoe",
  "gpt_oss",
)
VOCAB_SIZE = 512

_COMMON = dict(
  vocab_size=VOCAB_SIZE,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=512,
  rms_norm_eps=1e-6,
  bos_token_id=1,
  eos_token_id=2,
  pad_token_id=0,
)
_ARCH = {
  "llama": (
    transformers.LlamaConfig,
    dict(
      head_dim=32,
      rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10_000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
      ),
    ),
  ),
  "mistral": (
    transformers.MistralConfig,
    dict(sliding_window=48, rope_parameters=dict(rope_theta=1e6)),
  ),
  "qwen2": (transformers.Qwen2Config, dict(rope_parameters=dict(rope_theta=1e6))),
  "qwen3": (transformers.Qwen3Config, dict(head_dim=24, rope_parameters=dict(rope_theta=1e6))),
  "smollm3": (
    transformers.SmolLM3Config,
    dict(no_rope_layers=[1, 0], rope_parameters=dict(rope_theta=1e4)),
  ),
  "olmo2": (
    transformers.Olmo2Config,
    dict(rms_norm_eps=1e-5, rope_parameters=dict(rope_theta=5e5)),
  ),
  "phi3": (transformers.Phi3Config, dict(rms_norm_eps=1e-5, rope_parameters=dict(rope_theta=1e4))),
  "granite": (
    transformers.GraniteConfig,
    dict(
      embedding_multiplier=4.0,
      residual_multiplier=0.5,
      attention_multiplier=0.1,
      logits_scaling=3.0,
      rope_parameters=dict(rope_theta=1e4),
    ),
  ),
  "exaone4": (
    transformers.Exaone4Config,
    dict(
      rms_norm_eps=1e-5,
      sliding_window=48,
      layer_types=["sliding_attention", "full_attention"],
      rope_parameters=dict(rope_theta=1e4),
    ),
  ),
  "ernie4_5": (
    transformers.Ernie4_5Config,
    dict(head_dim=32, rms_norm_eps=1e-5, rope_parameters=dict(rope_theta=1e4)),
  ),
  "glm4": (
    transformers.Glm4Config,
    dict(
      head_dim=32,
      rms_norm_eps=1e-5,
      rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5),
    ),
  ),
  "seed_oss": (
    transformers.SeedOssConfig,
    dict(
      head_dim=32,
      attention_dropout=0.1,
      residual_dropout=0.1,
      rope_parameters=dict(rope_theta=1e6),
    ),
  ),
  "olmo3": (
    transformers.Olmo3Config,
    dict(
      rms_norm_eps=1e-5,
      sliding_window=48,
      layer_types=["sliding_attention", "full_attention"],
      rope_parameters={
        "full_attention": dict(
          rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64
        ),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
      },
    ),
  ),
  "qwen2_moe": (
    transformers.Qwen2MoeConfig,
    dict(
      moe_intermediate_size=32,
      shared_expert_intermediate_size=48,
      num_experts=8,
      num_experts_per_tok=2,
      rope_parameters=dict(rope_theta=1e4),
    ),
  ),
  "granitemoe": (
    transformers.GraniteMoeConfig,
    dict(
      intermediate_size=32,
      num_local_experts=8,
      num_experts_per_tok=2,
      embedding_multiplier=4.0,
      residual_multiplier=0.5,
      attention_multiplier=0.1,
      logits_scaling=3.0,
      rope_parameters=dict(rope_theta=1e4),
    ),
  ),
  "gpt_oss": (
    transformers.GptOssConfig,
    dict(
      head_dim=16,
      intermediate_size=32,
      num_local_experts=8,
      num_experts_per_tok=2,
      sliding_window=48,
      swiglu_limit=1.5,
      rope_parameters=dict(
        rope_type="yarn",
        rope_theta=1e4,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
      ),
    ),
  ),
  "mixtral": (
    transformers.MixtralConfig,
    dict(
      num_local_experts=8,
      num_experts_per_tok=2,
      intermediate_size=32,
      rms_norm_eps=1e-5,
      rope_parameters=dict(rope_theta=1e4),
    ),
  ),
  "olmoe": (
    transformers.OlmoeConfig,
    dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, rms_norm_eps=1e-5),
  ),
  "gemma3_text": (
    transformers.Gemma3TextConfig,
    dict(
      num_hidden_layers=5,
      head_dim=16,
      query_pre_attn_scalar=24,
      sliding_window=48,
      layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2,
      rope_parameters={
        "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e4),
        "sliding_attention": dict(rope_type="default", rope_theta=1e3),
      },
    ),
  ),
  "gemma2": (
    transformers.Gemma2Config,
    dict(
      num_hidden_layers=3,
      head_dim=16,
      query_pre_attn_scalar=24,
      sliding_window=48,
      attn_logit_softcapping=2.0,
      final_logit_softcapping=5.0,
      rope_parameters=dict(rope_theta=1e4),
    ),
  ),
  "qwen3_moe": (
    transformers.Qwen3MoeConfig,
    dict(
      head_dim=16,
      num_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=32,
      norm_topk_prob=True,
    ),
  ),
}


# Hub config.json files as published (the older layout: rope_theta, rope_scaling, torch_dtype),
# abridged; for config tests that need no weights.
QWEN3_0_6B = {
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": False,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": None,
  "rope_theta": 1000000,
  "sliding_window": None,
  "tie_word_embeddings": True,
  "torch_dtype": "bfloat16",
  "use_sliding_window": False,
  "vocab_size": 151936,
}
QWEN3_30B_A3B = QWEN3_0_6B | {
  "architectures": ["Qwen3MoeForCausalLM"],
  "model_type": "qwen3_moe",
  "decoder_sparse_step": 1,
  "hidden_size": 2048,
  "intermediate_size": 6144,
  "mlp_only_layers": [],
  "moe_intermediate_size": 768,
  "norm_topk_prob": True,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "rope_theta": 1000000.0,
  "tie_word_embeddings": False,
}
LLAMA_3_2_1B = {
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": False,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": False,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": True,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256,
}


def hf_config(arch: str, *, tied: bool = False, **overrides) -> transformers.PretrainedConfig:
  """The transformers config of a tiny `arch` model; `overrides` replace its fields."""
  if arch not in _ARCH:
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHS}")
  cls, fields = _ARCH[arch]
  return cls(**(_COMMON | fields | {"tie_word_embeddings": tied} | overrides))


def _randomize(model: torch.nn.Module, seed: int) -> None:
  """Weights of unit-scale activations: matrices N(0, 1/fan_in), norms 1 + N(0, 0.1^2), biases
  N(0, 0.1^2), embedding rows of unit norm. Router weights are 4x larger so that routing is
  decisive (no near-ties between experts)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if name.endswith("norm.weight") or "layernorm" in name:
        value = 1.0 + 0.1 * noise
      elif name.endswith(".bias"):
        value = 0.1 * noise
      elif "embed_tokens" in name:  # rows of unit norm: the layers, not the token, dominate
        value = noise / p.shape[-1] ** 0.5
      else:
        value = noise / p.shape[-1] ** 0.5
        if name.endswith(("mlp.gate.weight", "mlp.router.weight", "router.layer.weight")):
          value = 4.0 * value
      p.copy_(value.to(p.dtype))


def make_model(arch: str, *, tied: bool = False, seed: int = 0, **overrides):
  """A tiny random transformers model (float32, eager attention, eval mode)."""
  config = hf_config(arch, tied=tied, **overrides)
  config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  _randomize(model, seed)
  if tied:
    model.tie_weights()
  return model.eval()


def write_checkpoint(
  directory: str | os.PathLike,
  arch: str,
  *,
  tied: bool = False,
  seed: int = 0,
  dtype: str = "float32",
  max_shard_size: int | str | None = None,
  tokenizer: str | None = None,
  **overrides,
) -> str:
  """Writes a tiny random `arch` checkpoint into `directory` and returns the directory.

  Args:
    directory: created if needed.
    arch: one of `ARCHS`.
    tied: the LM head shares the embedding (no lm_head.weight on disk).
    seed: the weights' seed; the same arguments always write the same weights.
    dtype: "float32" or "bfloat16", the stored tensors' dtype.
    max_shard_size: shard the safetensors (e.g. "40KB") with an index file; None: one file.
    tokenizer: also write a tokenizer of this `helpers.hf_tokenizers` style ("qwen3",
      "llama3"); its ids fit in the 512-row embedding.
    **overrides: transformers config fields to change (e.g. norm_topk_prob=False).
  """
  directory = os.fspath(directory)
  model = make_model(arch, tied=tied, seed=seed, **overrides)
  if dtype != "float32":
    model = model.to(getattr(torch, dtype))
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(directory, **kwargs)
  if tokenizer is not None:
    from helpers import hf_tokenizers

    hf_tokenizers.write_tokenizer(directory, tokenizer)
  return directory


def load_model(directory: str | os.PathLike, dtype=torch.float32):
  """The checkpoint in `directory` as a transformers model (eager attention, eval mode)."""
  model = transformers.AutoModelForCausalLM.from_pretrained(
    os.fspath(directory), dtype=dtype, attn_implementation="eager"
  )
  return model.eval()


def logits(model, tokens_bt: np.ndarray) -> np.ndarray:
  """transformers' float32 logits `[b, t, vocab]` of a batch of token ids (no padding)."""
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long)).logits
  return out.float().numpy()


def jaxrl_logits(model, params, tokens_bt: np.ndarray, **kwargs) -> np.ndarray:
  """jaxrl's float32 logits of a batch (`kwargs` to `model.apply`), matmuls at full precision,
  jitted: one compilation costs less than compiling each eager op of a new model's shapes."""
  import functools

  import jax
  import jax.numpy as jnp

  with jax.default_matmul_precision("highest"):
    apply = jax.jit(functools.partial(model.apply, **kwargs))
    return np.asarray(apply(params, jnp.asarray(tokens_bt))[0])


def rel_err(got, want) -> float:
  """The largest absolute difference over the largest magnitude of `want`."""
  return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def router_margin(model, tokens_bt: np.ndarray) -> float:
  """The smallest gap, over tokens and MoE layers, between the router logit of the last expert
  chosen and the best one left out (inf for a dense model, or one whose every expert takes
  every token). Near 0, two float32 implementations (whose logits differ by ~1e-6) may route
  that token differently, so a logits comparison would fail on a tie, not on a bug. (Logits,
  not probabilities: a saturated softmax puts experts far apart in logits within 1e-6 of each
  other in probability.)"""
  if not getattr(model.config, "num_experts_per_tok", 0):
    return float("inf")
  k = model.config.num_experts_per_tok
  experts = getattr(model.config, "num_experts", None) or model.config.num_local_experts
  if k >= experts:
    return float("inf")
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long), output_router_logits=True)
  margin = float("inf")
  for logits_nx in out.router_logits:
    top = torch.topk(logits_nx.float(), k + 1, dim=-1).values
    margin = min(margin, float((top[:, k - 1] - top[:, k]).min()))
  return margin


def decisive_tokens(model, draw, tries: int = 50) -> tuple[np.ndarray, bool]:
  """Tokens from `draw()` that no MoE router of `model` (a transformers model) is near a tie
  on (`router_margin` over 1e-4), redrawn up to `tries` times; and whether they are. A token
  at a tie may go to either expert in float32 (seen in CI's runs), so a logits comparison on
  such a draw would fail on the tie, not on a bug. (Random tiny MoE checkpoints: router
  logits up to ~15, the smallest gap of a draw has a median of 4e-4 to 2e-3, under 1e-4 in up
  to a quarter of draws; fp32 differences move router logits by ~1e-5.)"""
  tokens = draw()
  for _ in range(tries):
    if router_margin(model, tokens) > 1e-4:
      return tokens, True
    tokens = draw()
  return tokens, False


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
  """transformers' greedy continuation of one prompt, exactly `max_new_tokens` long (no stop
  token ends it early)."""
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      do_sample=False,
      max_new_tokens=max_new_tokens,
      eos_token_id=None,
      pad_token_id=0,
    )
  return out[0, len(prompt) :].tolist()


def paged_greedy(directory: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int):
  """jaxrl's greedy continuations of `prompts` (at most 2) from the checkpoint in `directory`:
  the paged engine in float32, pages of 32 slots (a prompt past 32 tokens crosses a page), one
  prefill and one decode window (one compilation each). Compare with `greedy`."""
  import jax

  from jaxrl.model import load_pretrained
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.rollout.sampling import SamplingParams
  from jaxrl.sharding import STAGE_RULES, make_mesh

  model, params = load_pretrained(directory, dtype="float32")
  mesh = make_mesh(jax.devices()[:1], {"data": 1})
  longest = max(map(len, prompts))
  config = PagedConfig(
    page_size=32,
    num_pages=8,
    max_running=2,
    prefill_chunk=32 * -(-longest // 32),
    decode_steps=max_new_tokens,
  )
  engine = PagedEngine(model, mesh, STAGE_RULES["rollout"], eos_id=2, pad_id=0, config=config)
  engine.update_weights(params, 0)
  sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
  return [c.token_ids.tolist() for c in engine.generate(prompts, sampling, seed=0)]


def write_gemma3_multimodal(directory: str | os.PathLike, *, seed: int = 0) -> str:
  """A tiny random Gemma3ForConditionalGeneration (Gemma 3 4B and up): the "gemma3_text"
  language model of `ARCHS`, tied, under a one-layer SigLIP vision tower, saved as transformers
  saves it (the Hub's layout: `language_model.model.*`, `vision_tower.*`,
  `multi_modal_projector.*`; config.json with text_config and vision_config)."""
  text = hf_config("gemma3_text", tied=True)
  vision = transformers.SiglipVisionConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
  )
  config = transformers.Gemma3Config(
    text_config=text.to_dict(),
    vision_config=vision.to_dict(),
    mm_tokens_per_image=4,
    boi_token_index=VOCAB_SIZE - 3,
    eoi_token_index=VOCAB_SIZE - 2,
    image_token_index=VOCAB_SIZE - 1,
    eos_token_id=[2, 5],
  )
  config._attn_implementation = "eager"
  model = transformers.Gemma3ForConditionalGeneration(config)
  _randomize(model, seed)
  model.tie_weights()
  model.eval().save_pretrained(os.fspath(directory))
  return os.fspath(directory)
