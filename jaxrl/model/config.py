"""Model shapes: one frozen dataclass and the named presets."""

from __future__ import annotations

import dataclasses

DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("dense", "flash", "cudnn")
MOE_DISPATCHES = ("dense", "grouped")
ROPE_SCALINGS = (
  "",
  "llama3",
  "linear",
  "yarn",
  "longrope",
)  # jaxrl/model/rope.py says what each does
# What a rematerialised block keeps for the backward pass (`ModelConfig.remat_policy`).
REMAT_POLICIES = ("full", "save_attention", "save_dots")
NORM_POSITIONS = ("pre", "post", "sandwich")
MLP_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and options of a decoder-only transformer (dense or MoE).

  Attributes:
    vocab_size: number of token ids the embedding covers.
    d_model: residual stream width.
    num_layers: decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    head_dim: width of one attention head.
    mlp_dim: hidden width of the dense SwiGLU MLP.
    max_seq_len: longest sequence (prompt + response) the model is used with.
    rope_theta: RoPE base frequency.
    rope_scaling: "" for plain RoPE; "llama3" (Llama 3.1's frequency-dependent scaling: low
      frequencies divided by rope_factor, high ones kept, a smooth blend in between);
      "linear" (every frequency divided by rope_factor); "yarn" (YaRN, Qwen2.5/Qwen3's long
      context: low frequencies interpolated, high ones kept, cos and sin scaled by an
      attention factor); "longrope" (Phi-3.5, Phi-4-mini: every frequency divided by its own
      factor, short ones before `rope_original_max_position_embeddings` and long ones from
      there on, cos and sin scaled by an attention factor). `jaxrl/model/rope.py` has the
      formulas.
    rope_factor: llama3, linear and yarn: how much the low frequencies are stretched;
      longrope: the context's extension, from which its default attention factor follows.
    rope_low_freq_factor: llama3 scaling: wavelengths above original_max / this are scaled.
    rope_high_freq_factor: llama3 scaling: wavelengths below original_max / this are kept.
    rope_original_max_position_embeddings: llama3, yarn and longrope: the context length the
      model was pretrained with before the scaling.
    rope_beta_fast: yarn: dimensions turning more than this many times over the original
      context keep their frequency.
    rope_beta_slow: yarn: dimensions turning fewer than this many times are interpolated.
    rope_attention_factor: yarn and longrope: what cos and sin are multiplied by; 0 takes
      YaRN's `0.1 ln(rope_factor) + 1`, or LongRoPE's
      `sqrt(1 + ln(rope_factor) / ln(rope_original_max_position_embeddings))`.
    rope_truncate: yarn: round the ramp's ends to whole dimensions (transformers' default).
    rope_short_factor, rope_long_factor: longrope: the divisor of each frequency (one per
      rotated pair, `rotary_dim // 2`) at positions before and from the original context.
    rotary_dim: dimensions of each query and key head that RoPE rotates (Phi-4-mini: 96 of
      128); 0 rotates the whole head. A checkpoint rotates its heads' first `rotary_dim`
      dimensions (pairs `i, i + rotary_dim / 2`); jaxrl stores q and k heads with those pairs
      at `i, i + head_dim / 2` and the others, unrotated, between (`rope.partial_rotary_order`;
      the checkpoint reader and writer reorder them), so every attention path and kernel
      rotates whole heads, the unrotated pairs by angle 0.
    nope_layers: indices of the layers whose attention uses no positional rotation (NoPE:
      SmolLM3 leaves every fourth layer unrotated); () rotates in every layer.
    norm_eps: RMSNorm epsilon.
    qk_norm: RMSNorm on each query/key head before RoPE (Qwen3).
    qk_norm_across_heads: with qk_norm, normalise each token's whole query (and key)
      projection, all heads at once, with a scale per head and dimension (OLMo 2).
    norm_position: "pre" (Llama, Qwen): each sublayer's input is RMS-normed; "post" (OLMo 2):
      its output is, before it is added to the residual stream; "sandwich" (Gemma 2 and 3):
      both, two norms per sublayer.
    norm_scale_plus_one: RMSNorm multiplies by `1 + scale` in float32 and then rounds (Gemma's
      checkpoints store the scales minus one); False multiplies by `scale` after rounding
      (Llama's order). The q/k norms too.
    mlp_activation: the gate's activation in the gated MLP: "silu" (SwiGLU), "gelu_tanh"
      (GeGLU with GELU's tanh approximation: Gemma) or "clamped_swiglu" (gpt-oss:
      `(clip(up, -l, l) + 1) * g * sigmoid(a * g)` with `g = min(gate, l)`, a =
      `swiglu_alpha`, l = `swiglu_limit`). MoE experts take "silu" or "clamped_swiglu".
    swiglu_alpha, swiglu_limit: "clamped_swiglu"'s a and l (gpt-oss: 1.702 and 7).
    scale_embeddings: token embeddings are multiplied by `sqrt(d_model)`, rounded to the
      compute dtype (Gemma).
    attention_logit_scale: what attention logits are multiplied by; 0 takes `head_dim ** -0.5`
      (Gemma: `query_pre_attn_scalar ** -0.5`; Granite: `attention_multiplier`).
    embedding_multiplier: token embeddings are multiplied by this (Granite: 12), in the
      compute dtype; 1 leaves them.
    residual_multiplier: each sublayer's output is multiplied by this before it joins the
      residual stream (Granite: 0.22); 1 adds it as it is.
    logits_scaling: the LM head's logits are divided by this (Granite: 8 or 16): the final
      norm's output is, in the compute dtype, so that the learner's blockwise LM head
      (`return_hidden`) divides them too; 1 leaves them.
    sliding_window: in the layers of `sliding_layers`, a query attends to this many positions,
      its own included (keys at positions `> q - sliding_window`: Mistral, Phi-3, Gemma 3's
      local layers); 0 with no sliding layers.
    sliding_layers: indices of the layers with the window; the others attend to every earlier
      position.
    attention_logit_softcap: attention logits `s` become `c * tanh(s / c)` before the mask and
      the softmax (Gemma 2: c = 50); 0 leaves them.
    final_logit_softcap: the LM head's float32 logits likewise (Gemma 2: 30), before sampling
      and log-probs alike; 0 leaves them.
    local_rope_theta: RoPE base of the sliding layers, which then rotate with plain RoPE
      (Gemma 3: 10,000 there, 1,000,000 and the scaling in the others); 0 rotates every layer
      alike.
    qkv_bias: bias on the q/k/v projections (Qwen2).
    attention_out_bias: bias on the attention's output projection (gpt-oss).
    attention_sinks: a learned sink logit per query head in every layer (gpt-oss): it joins
      each query's softmax with a zero value, so attention can put weight on nothing.
    tie_embeddings: the LM head reuses the token embedding.
    num_experts: 0 for a dense MLP, otherwise the experts of every MoE layer.
    experts_per_token: top-k experts each token is routed to.
    moe_mlp_dim: hidden width of one expert.
    norm_topk_prob: renormalise the top-k router probabilities to sum to one (Qwen3-MoE's
      checkpoints say which); False keeps the raw softmax probabilities as combine weights.
    moe_biases: a bias on the router's logits and on each expert's gate, up and down
      projections (gpt-oss).
    shared_expert_dim: the width of a dense gated expert every token of an MoE layer takes
      beside its routed ones (Qwen2-MoE, Granite MoE shared); 0 for none.
    shared_expert_gate: the shared expert's output is scaled by `sigmoid(x . w)`, a learned
      gate per token (Qwen2-MoE).
    dtype: compute dtype; parameters stay in param_dtype and are cast at use. (An experiment
      config may say "auto": bf16 on accelerators, fp32 on CPU; `jaxrl.auto_config.auto_settings`.)
    param_dtype: storage dtype of parameters.
    vocab_limit: ids the tokenizer can produce; logits of embedding rows at and past it (tables
      padded beyond the vocabulary, e.g. 151,936 rows for Qwen3's 151,669 ids) are masked out of
      sampling and log-probs. 0: every row is a token.
    remat: recompute each block's activations in the backward pass instead of storing them
      (training memory grows with one block, not with depth, for one more forward pass).
    remat_policy: with `remat`, what each block keeps for the backward pass besides its input:
      "full" nothing (the whole block's forward runs again); "save_attention" flash
      attention's output and log-sum-exp (`t * h * e` values and `h * t` floats a layer;
      cuDNN's statistics are `max_segments` times as many floats with packed rows), so
      the backward does not run the attention forward again, the costliest part of long rows
      (with `attention="dense"` nothing is saved: its backward needs the `[t, t]`
      probabilities, which are recomputed); "save_dots" that and every projection's output
      (q, k, v, o and the MLP's: about `2 * (h + k) * e + 3 * f` values a token and layer), so
      that only norms, RoPE and activations run again.
    attention: the attention of forward passes without a KV cache (training, log-probs):
      "dense" materialises `[t, t]` scores per head; "flash" runs
      `jaxrl.kernels.flash_attention` (blockwise, memory linear in t; the Pallas kernel on a
      GPU or TPU, the jnp reference on CPU), same result to rounding; "cudnn" runs it through
      cuDNN's fused attention (`impl="cudnn"`: an NVIDIA GPU, bf16, Hopper or later for
      packed rows; a batch whose packed rows cuDNN cannot take runs the Pallas kernel).
      Rollout's packed prefill of prompts (each prompt's keys all in its row) takes it too;
      its decode and chunked prefill read the paged cache. (An experiment config may say
      "auto": on Hopper GPUs cuDNN for bf16 checkpoints and models from 1,024 wide, flash
      for narrower or float32 ones; dense elsewhere; `jaxrl.auto_config`.)
    scan_layers: forward passes without a KV cache (training, log-probs) and packed
      prefills (whose attention reads only the row's own keys; the pages are written after,
      and the last block stays unrolled) run the blocks as one `lax.scan` over their weights
      stacked along a layer axis, so that the program holds one block instead of
      `num_layers` copies: compiled for an H100, the HF recipe's update (Qwen3-0.6B, 28
      layers) took 35.7 s instead of 69.4 s, its 8-row packed prefill 8.0 s instead of 13.1
      (docs/BENCHMARKS.md), with the same result. The stacked weights are a copy in the
      compute dtype made inside the program (the parameters themselves keep one tree of
      layers, as checkpoints, shardings and the rollout engine see them). That copy, and in
      training its stacked gradient, cost the blocks' weights in the compute dtype once
      (packed prefill) or twice (learner) per device, where unrolled blocks cast one layer at
      a time: small for Qwen3-0.6B (0.82 GiB each), large for big models on few devices
      (gpt-oss-20b on one H100: a 2k-token micro-step's temporaries 77.0 GiB scanned against
      4.75 unrolled, the engine's packed prefill 34.7 against 0.32; docs/BENCHMARKS.md). So
      the learner and the paged engine turn it off where those copies would take more than a
      tenth of a device's memory as the device reports it (GPU, TPU;
      `jaxrl.model.scan_fit`), and the learner on several CPU devices that exchange data
      (XLA:CPU can deadlock its collectives in and after the scan). False unrolls the
      blocks, as passes that read a cache (decode, chunked prefill) always do.
    moe_dispatch: how an MoE layer runs its experts on a mesh without an expert axis (size 1;
      with one the layer is expert-parallel, `jaxrl.sharding.moe_expert_parallel`): "dense"
      runs every expert on every token and zeroes the outputs of the experts a token did not
      choose (`num_experts / experts_per_token` times the routed FLOPs, and `[tokens,
      experts, width]` activations); "grouped" sorts each token's k assignments by expert and
      runs `jaxrl.kernels.gmm` on them (the expert-parallel layer on the one-device expert
      axis: the tokens split over the data and fsdp axes, the expert weights gathered like
      fsdp), same result to rounding. A tensor-parallel mesh (tensor > 1) runs "dense", whose
      einsums XLA splits over that axis. (An experiment config may say "auto": "grouped" on
      Hopper GPUs, where `gmm` was measured, "dense" elsewhere; `jaxrl.auto_config`.)
  """

  vocab_size: int = 64
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  max_seq_len: int = 64
  rope_theta: float = 10_000.0
  rope_scaling: str = ""
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position_embeddings: int = 8192
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 0.0
  rope_truncate: bool = True
  rope_short_factor: tuple[float, ...] = ()
  rope_long_factor: tuple[float, ...] = ()
  rotary_dim: int = 0
  nope_layers: tuple[int, ...] = ()
  norm_eps: float = 1e-6
  qk_norm: bool = False
  qk_norm_across_heads: bool = False
  norm_position: str = "pre"
  norm_scale_plus_one: bool = False
  mlp_activation: str = "silu"
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  scale_embeddings: bool = False
  attention_logit_scale: float = 0.0
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  logits_scaling: float = 1.0
  sliding_window: int = 0
  sliding_layers: tuple[int, ...] = ()
  local_rope_theta: float = 0.0
  attention_logit_softcap: float = 0.0
  final_logit_softcap: float = 0.0
  qkv_bias: bool = False
  attention_out_bias: bool = False
  attention_sinks: bool = False
  tie_embeddings: bool = True
  num_experts: int = 0
  experts_per_token: int = 2
  moe_mlp_dim: int = 0
  norm_topk_prob: bool = True
  moe_biases: bool = False
  shared_expert_dim: int = 0
  shared_expert_gate: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  vocab_limit: int = 0
  remat: bool = False
  remat_policy: str = "full"
  attention: str = "dense"
  scan_layers: bool = True
  moe_dispatch: str = "dense"

  def __post_init__(self):
    for name in (
      "vocab_size",
      "d_model",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "mlp_dim",
      "max_seq_len",
    ):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
        f"({self.num_kv_heads}) for grouped-query attention."
      )
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim must be even for RoPE, got {self.head_dim}.")
    if self.rope_theta <= 0:
      raise ValueError(f"model.rope_theta must be > 0, got {self.rope_theta}.")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(
        f"model.rope_scaling must be one of {ROPE_SCALINGS} ('' = plain RoPE), "
        f"got {self.rope_scaling!r}."
      )
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0 (1 = none), got {getattr(self, name)}.")
    if self.rotary_dim and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
      raise ValueError(
        f"model.rotary_dim must be 0 (the whole head) or even and at most head_dim="
        f"{self.head_dim}, got {self.rotary_dim}."
      )
    if self.rope_scaling:
      self._check_rope_scaling()
    if list(self.nope_layers) != sorted(set(self.nope_layers)) or not all(
      0 <= i < self.num_layers for i in self.nope_layers
    ):
      raise ValueError(
        f"model.nope_layers must be increasing layer indices in [0, num_layers="
        f"{self.num_layers}), got {self.nope_layers!r}."
      )
    if self.num_experts < 0:
      raise ValueError(f"model.num_experts must be >= 0 (0 = dense), got {self.num_experts}.")
    if self.num_experts:
      if not 1 <= self.experts_per_token <= self.num_experts:
        raise ValueError(
          f"model.experts_per_token must be in [1, num_experts={self.num_experts}], "
          f"got {self.experts_per_token}."
        )
      if self.moe_mlp_dim < 1:
        raise ValueError("model.moe_mlp_dim must be >= 1 when model.num_experts > 0.")
    if not 0 <= self.vocab_limit <= self.vocab_size:
      raise ValueError(
        f"model.vocab_limit must be in [0, vocab_size={self.vocab_size}] (0 = all rows), "
        f"got {self.vocab_limit}."
      )
    if self.norm_position not in NORM_POSITIONS:
      raise ValueError(
        f"model.norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}."
      )
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(
        f"model.mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}."
      )
    if self.mlp_activation == "gelu_tanh" and self.num_experts:
      raise ValueError(
        f"model.mlp_activation={self.mlp_activation!r}: jaxrl's MoE experts are SwiGLU; use "
        "'silu' or 'clamped_swiglu' with model.num_experts > 0."
      )
    if (self.moe_biases or self.shared_expert_dim) and not self.num_experts:
      raise ValueError(
        "model.moe_biases and model.shared_expert_dim are options of an MoE: they need "
        "model.num_experts > 0."
      )
    if self.shared_expert_dim < 0 or (self.shared_expert_gate and not self.shared_expert_dim):
      raise ValueError(
        f"model.shared_expert_dim must be >= 0 (0: none), and model.shared_expert_gate needs "
        f"one; got {self.shared_expert_dim} and {self.shared_expert_gate}."
      )
    if not (self.swiglu_alpha > 0 and self.swiglu_limit > 0):
      raise ValueError(
        f"model.swiglu_alpha and model.swiglu_limit must be > 0, got {self.swiglu_alpha} and "
        f"{self.swiglu_limit}."
      )
    if self.attention_logit_scale < 0:
      raise ValueError(
        "model.attention_logit_scale must be >= 0 (0 = head_dim ** -0.5), got "
        f"{self.attention_logit_scale}."
      )
    self._check_sliding_layers()
    for name in ("attention_logit_softcap", "final_logit_softcap"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name} must be >= 0 (0 = none), got {getattr(self, name)}.")
    if self.qk_norm_across_heads and self.norm_scale_plus_one:
      raise ValueError(
        "model.norm_scale_plus_one=True with model.qk_norm_across_heads=True is not "
        "implemented (no checkpoint has both): the norm across heads scales by `scale`."
      )
    if self.qk_norm_across_heads and not self.qk_norm:
      raise ValueError("model.qk_norm_across_heads=True needs model.qk_norm=True.")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
        f"model.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}."
      )
    if self.remat_policy != "full" and not self.remat:
      raise ValueError(
        f"model.remat_policy={self.remat_policy!r} only applies to rematerialised blocks: set "
        "model.remat=True, or leave remat_policy at 'full'."
      )
    if self.attention not in ATTENTIONS:
      raise ValueError(f"model.attention must be one of {ATTENTIONS}, got {self.attention!r}.")
    if self.moe_dispatch not in MOE_DISPATCHES:
      raise ValueError(
        f"model.moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}."
      )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name} must be one of {DTYPES}, got {getattr(self, name)!r}.")
    if self.attention == "cudnn" and self.dtype != "bfloat16":
      raise ValueError(
        f"model.attention='cudnn' computes in bfloat16 (cuDNN's fused attention), got "
        f"model.dtype={self.dtype!r}: set model.dtype=bfloat16, or model.attention=flash."
      )

  def _check_sliding_layers(self):
    layers = self.sliding_layers
    if list(layers) != sorted(set(layers)) or not all(0 <= i < self.num_layers for i in layers):
      raise ValueError(
        f"model.sliding_layers must be increasing layer indices in [0, num_layers="
        f"{self.num_layers}), got {layers!r}."
      )
    if self.sliding_window < 0 or bool(self.sliding_window) != bool(layers):
      raise ValueError(
        f"model.sliding_window={self.sliding_window} with model.sliding_layers={layers!r}: "
        "give a window >= 1 and the layers it applies to, or 0 and ()."
      )
    if self.local_rope_theta < 0 or (self.local_rope_theta and not layers):
      raise ValueError(
        f"model.local_rope_theta={self.local_rope_theta} applies to the sliding layers: give "
        "model.sliding_layers, or leave it 0."
      )

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer` (a Python int), None where it sees every position."""
    return self.sliding_window if layer in self.sliding_layers else None

  def _check_rope_scaling(self):
    kind = self.rope_scaling
    if self.rope_factor < 1:
      raise ValueError(
        f"model.rope_factor must be >= 1 for {kind} scaling, got {self.rope_factor}."
      )
    if kind != "linear" and self.rope_original_max_position_embeddings < 1:
      raise ValueError(
        f"model.rope_original_max_position_embeddings must be >= 1 for {kind} scaling, got "
        f"{self.rope_original_max_position_embeddings}."
      )
    if kind == "llama3":
      if self.rope_low_freq_factor <= 0:
        raise ValueError(
          "model.rope_low_freq_factor must be > 0 for llama3 scaling, got "
          f"{self.rope_low_freq_factor}."
        )
      if self.rope_high_freq_factor <= self.rope_low_freq_factor:
        raise ValueError(
          f"model.rope_high_freq_factor ({self.rope_high_freq_factor}) must be greater than "
          f"model.rope_low_freq_factor ({self.rope_low_freq_factor}) for llama3 scaling."
        )
    if kind == "longrope":
      pairs = (self.rotary_dim or self.head_dim) // 2
      for name in ("rope_short_factor", "rope_long_factor"):
        factors = getattr(self, name)
        if len(factors) != pairs or min(factors) <= 0:
          raise ValueError(
            f"model.{name} must hold {pairs} factors > 0 (one per rotated pair of "
            f"{self.rotary_dim or self.head_dim} dimensions) for longrope, got {len(factors)}"
            f"{f' (smallest {min(factors)})' if factors else ''}."
          )
    if kind in ("yarn", "longrope") and self.rope_attention_factor < 0:
      raise ValueError(
        f"model.rope_attention_factor must be >= 0 (0 = {kind}'s default) for {kind} scaling, "
        f"got {self.rope_attention_factor}."
      )
    if kind == "yarn" and not 0 < self.rope_beta_slow <= self.rope_beta_fast:
      raise ValueError(
        f"model.rope_beta_slow ({self.rope_beta_slow}) must be > 0 and at most "
        f"model.rope_beta_fast ({self.rope_beta_fast}) for yarn scaling."
      )

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, e = self.d_model, self.head_dim
    attn = d * e * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += e * (self.num_heads + 2 * self.num_kv_heads)
    attn += self.num_heads if self.attention_sinks else 0
    attn += d if self.attention_out_bias else 0
    if self.qk_norm:  # across heads (OLMo): a scale per head and dimension
      attn += (self.num_heads + self.num_kv_heads) * e if self.qk_norm_across_heads else 2 * e
    if self.is_moe:
      mlp = d * self.num_experts + self.num_experts * 3 * d * self.moe_mlp_dim
      if self.moe_biases:
        mlp += self.num_experts * (1 + 2 * self.moe_mlp_dim + d)
      mlp += 3 * d * self.shared_expert_dim + (d if self.shared_expert_gate else 0)
    else:
      mlp = 3 * d * self.mlp_dim
    per_layer = attn + mlp + (4 if self.norm_position == "sandwich" else 2) * d
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.num_layers * per_layer + self.vocab_size * d + head + d
