"""Flax NNX decoder-only transformer: RMSNorm, RoPE, GQA, SwiGLU or MoE, optional KV cache.

Glossary: b batch, t query positions, s key positions (cache slots), d model width,
h query heads, k kv heads, g query heads per kv head, e head dim, f mlp width, v vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.kernels.common import softcap
from jaxrl.kernels.flash_attention import save_attention_policy
from jaxrl.kernels.partitioning import KernelMesh
from jaxrl.kernels.qk_rope_write import apply_rope, rms_norm
from jaxrl.model.cache import (
  LogitRule,
  PackedPrefillCache,
  PackedPrefillKeys,
  PagedLayerCache,
  attend,
  attend_paged_decode,
  write_packed_prefill,
)
from jaxrl.model.config import ModelConfig
from jaxrl.model.moe import MoEInputs, MoEMLP, gated_unit, param
from jaxrl.model.rope import rope_cos_sin


def _remat_block(cfg, moe, layer: int, kernel_mesh):
  """Block `layer` of a pass without a cache under `nnx.remat`, called as `(block, x,
  positions, segment ids)`. The layer and its window are closed over, not passed: `nnx.remat`
  traces a function's defaults too, and a traced layer index has no window to look up."""
  window = cfg.layer_window(layer)
  return nnx.remat(
    lambda blk, x, pos, seg: blk(x, pos, None, moe, layer, seg, window, kernel_mesh),
    policy=remat_policy(cfg.remat_policy),
  )


def remat_policy(name: str):
  """The `jax.checkpoint` policy of `ModelConfig.remat_policy` (None: save nothing).
  "save_attention" keeps flash attention's (or cuDNN's) output and softmax statistics."""
  if name == "save_attention":
    return save_attention_policy
  if name == "save_dots":
    # Projections are dots without batch dimensions; attention's einsums have (b, h) ones.
    return jax.checkpoint_policies.save_from_both_policies(
      jax.checkpoint_policies.dots_with_no_batch_dims_saveable, save_attention_policy
    )
  return None


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, param_dtype, plus_one: bool = False):
    self.eps, self.plus_one = eps, plus_one
    # Gemma stores scales minus one: zeros are its identity, ones Llama's.
    init = jnp.zeros if plus_one else jnp.ones
    self.scale = nnx.Param(init((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x):
    return rms_norm(x, self.scale.get_value(), self.eps, self.plus_one)

  def scale_times(self, mult: float):
    """The stored scale of a norm whose output is this one's times `mult` (folded into the
    scale, so rounded once with it): float32 for Gemma's `1 + scale`."""
    scale = self.scale.get_value()
    if mult == 1.0:
      return scale
    if self.plus_one:
      return (1.0 + scale.astype(jnp.float32)) * mult - 1.0
    return scale * mult


class HeadsRMSNorm(nnx.Module):
  """RMSNorm over all heads of a token's projection at once (`[..., n, e]`, scale `[n, e]`):
  OLMo 2's q/k norm. Heads sharded over a mesh axis reduce across it."""

  def __init__(self, heads: int, dim: int, eps: float, param_dtype, heads_axis: str):
    self.eps = eps
    self.scale = nnx.Param(
      jnp.ones((heads, dim), param_dtype), logical_axes=(heads_axis, "head_dim")
    )

  def __call__(self, x_bthe):
    shape = x_bthe.shape
    flat = rms_norm(x_bthe.reshape(*shape[:-2], -1), self.scale.get_value().reshape(-1), self.eps)
    return flat.reshape(shape)


class Attention(nnx.Module):
  """Grouped-query attention; writes its keys/values into the cache when one is given."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, k, e = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.wq_dhe = param(rngs, (d, h, e), ("embed", "heads", "head_dim"), d, pd)
    self.wk_dke = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), d, pd)
    self.wv_dke = param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), d, pd)
    self.wo_hed = param(rngs, (h, e, d), ("heads", "head_dim", "embed"), h * e, pd)
    if cfg.qkv_bias:
      self.bq_he = nnx.Param(jnp.zeros((h, e), pd), logical_axes=("heads", "head_dim"))
      self.bk_ke = nnx.Param(jnp.zeros((k, e), pd), logical_axes=("kv_heads", "head_dim"))
      self.bv_ke = nnx.Param(jnp.zeros((k, e), pd), logical_axes=("kv_heads", "head_dim"))
    if cfg.attention_out_bias:
      self.bo_d = nnx.Param(jnp.zeros((d,), pd), logical_axes=("embed",))
    if cfg.attention_sinks:  # zero: each sink starts as one more key of logit 0
      self.sinks_h = nnx.Param(jnp.zeros((h,), pd), logical_axes=("heads",))
    if cfg.qk_norm and cfg.qk_norm_across_heads:
      self.q_norm = HeadsRMSNorm(h, e, cfg.norm_eps, pd, "heads")
      self.k_norm = HeadsRMSNorm(k, e, cfg.norm_eps, pd, "kv_heads")
    elif cfg.qk_norm:
      self.q_norm = RMSNorm(e, cfg.norm_eps, pd, cfg.norm_scale_plus_one)
      self.k_norm = RMSNorm(e, cfg.norm_eps, pd, cfg.norm_scale_plus_one)

  def __call__(
    self, x_btd, positions_bt, cache, segment_ids_bt=None, layer=0, window=None, kernel_mesh=None
  ):  # fmt: skip
    """`layer`: this block's index (traced in a scanned stack), for `cfg.nope_layers`;
    `window`: its sliding window (static; `ModelConfig.layer_window`), None for none;
    `kernel_mesh`: the attention kernels' `KernelMesh` (`Transformer.__call__`)."""
    cfg = self.cfg
    dt = x_btd.dtype
    q = jnp.einsum("btd,dhe->bthe", x_btd, self.wq_dhe.get_value().astype(dt))
    k = jnp.einsum("btd,dke->btke", x_btd, self.wk_dke.get_value().astype(dt))
    v = jnp.einsum("btd,dke->btke", x_btd, self.wv_dke.get_value().astype(dt))
    if cfg.qkv_bias:
      q = q + self.bq_he.get_value().astype(dt)
      k = k + self.bk_ke.get_value().astype(dt)
      v = v + self.bv_ke.get_value().astype(dt)
    cos_btf, sin_btf = rope_cos_sin(positions_bt, cfg, layer, local=window is not None)
    # A logit scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar) multiplies
    # the queries after their norm: the rotation is linear, so it commutes.
    q_mult = cfg.attention_logit_scale * cfg.head_dim**0.5 if cfg.attention_logit_scale else 1.0
    sinks = self.sinks_h.get_value() if cfg.attention_sinks else None
    rule = LogitRule(window, cfg.attention_logit_softcap or None, sinks)
    if cfg.qk_norm_across_heads:  # a norm over all heads: not the fused kernel's per-head one
      q, k = self.q_norm(q), self.k_norm(k)
    per_head_norm = cfg.qk_norm and not cfg.qk_norm_across_heads
    if isinstance(cache, PagedLayerCache) and q.shape[1] == 1:
      # A decode step: the norms, the rotation and the cache write are one kernel on a GPU.
      scales = ()
      if per_head_norm:
        scales = (self.q_norm.scale_times(q_mult), self.k_norm.scale_times(1.0))
      elif q_mult != 1.0:
        q = q * jnp.asarray(q_mult, dt)
      out_bthe, cache = attend_paged_decode(
        q, k, v, positions_bt, cache, cos_btf, sin_btf, *scales, eps=cfg.norm_eps,
        norm_plus_one=cfg.norm_scale_plus_one, kernel_mesh=kernel_mesh, **rule._asdict(),
      )  # fmt: skip
    else:
      if per_head_norm:
        q, k = self.q_norm(q), self.k_norm(k)
      if q_mult != 1.0:
        q = q * jnp.asarray(q_mult, dt)
      q, k = apply_rope(q, cos_btf, sin_btf), apply_rope(k, cos_btf, sin_btf)
      out_bthe, cache = attend(
        q, k, v, positions_bt, cache, segment_ids_bt, attention=cfg.attention,
        kernel_mesh=kernel_mesh, **rule._asdict(),
      )  # fmt: skip
    out_btd = jnp.einsum("bthe,hed->btd", out_bthe, self.wo_hed.get_value().astype(dt))
    if cfg.attention_out_bias:
      out_btd = out_btd + self.bo_d.get_value().astype(dt)
    return out_btd, cache


class MLP(nnx.Module):
  """Gated feed-forward (`moe.gated_unit`: SwiGLU, or GeGLU for Gemma); returns (output,
  None) to match `MoEMLP`'s (output, routing)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.w_gate_df = param(rngs, (d, f), ("embed", "mlp"), d, pd)
    self.w_up_df = param(rngs, (d, f), ("embed", "mlp"), d, pd)
    self.w_down_fd = param(rngs, (f, d), ("mlp", "embed"), f, pd)

  def __call__(self, x_btd, moe=None, layer=0):
    del moe, layer  # a dense MLP has no routing
    dt = x_btd.dtype
    gate = jnp.einsum("btd,df->btf", x_btd, self.w_gate_df.get_value().astype(dt))
    up = jnp.einsum("btd,df->btf", x_btd, self.w_up_df.get_value().astype(dt))
    down_fd = self.w_down_fd.get_value().astype(dt)
    hidden = gated_unit(self.cfg)(gate, up)
    return jnp.einsum("btf,fd->btd", hidden, down_fd), None


class Block(nnx.Module):
  """One decoder layer. Norms by `ModelConfig.norm_position`: "pre" norms each sublayer's input
  (`attn_norm`, `mlp_norm`), "post" its output (the same two), "sandwich" both (`attn_norm`
  and `mlp_norm` before, `attn_post_norm` and `mlp_post_norm` after)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    norm_args = (cfg.d_model, cfg.norm_eps, pd, cfg.norm_scale_plus_one)
    self.attn_norm = RMSNorm(*norm_args)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(*norm_args)
    self.mlp = MoEMLP(cfg, rngs=rngs) if cfg.is_moe else MLP(cfg, rngs=rngs)
    if cfg.norm_position == "sandwich":
      self.attn_post_norm = RMSNorm(*norm_args)
      self.mlp_post_norm = RMSNorm(*norm_args)

  def __call__(
    self, x_btd, positions_bt, cache, moe: MoEInputs | None, layer: int, segment_ids_bt=None,
    window: int | None = None, kernel_mesh=None,
  ):  # fmt: skip
    """Returns (output, cache, an MoE MLP's `MoERouting` or None). `window`: the layer's
    sliding window (static), None for full attention; `kernel_mesh`: the attention kernels'
    `KernelMesh`."""
    position, multiplier = self.attn.cfg.norm_position, self.attn.cfg.residual_multiplier
    attn_args = (positions_bt, cache, segment_ids_bt, layer, window, kernel_mesh)

    def add(x_btd, out_btd):  # Granite scales what joins the residual stream
      return x_btd + (
        out_btd * jnp.asarray(multiplier, out_btd.dtype) if multiplier != 1 else out_btd
      )

    if position == "post":  # OLMo 2: sublayer outputs normed, inputs not
      attn_out, cache = self.attn(x_btd, *attn_args)
      x_btd = add(x_btd, self.attn_norm(attn_out))
      mlp_out, routing = self.mlp(x_btd, moe, layer)
      return add(x_btd, self.mlp_norm(mlp_out)), cache, routing
    attn_out, cache = self.attn(self.attn_norm(x_btd), *attn_args)
    if position == "sandwich":
      attn_out = self.attn_post_norm(attn_out)
    x_btd = add(x_btd, attn_out)
    mlp_out, routing = self.mlp(self.mlp_norm(x_btd), moe, layer)
    if position == "sandwich":
      mlp_out = self.mlp_post_norm(mlp_out)
    return add(x_btd, mlp_out), cache, routing


class Transformer(nnx.Module):
  """Decoder-only language model. Call with token ids; returns logits and the updated cache."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = jnp.dtype(cfg.param_dtype)
    self.embed_vd = nnx.Param(
      jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), pd) * cfg.d_model**-0.5,
      logical_axes=("vocab", "embed"),
    )
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd, cfg.norm_scale_plus_one)
    if not cfg.tie_embeddings:
      self.lm_head_dv = param(
        rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.d_model, pd
      )

  def __call__(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array | None = None,
    cache: tuple | None = None,
    return_routing: bool = False,
    moe: MoEInputs | None = None,
    return_hidden: bool = False,
    segment_ids_bt: jax.Array | None = None,
    return_moe_counts: bool = False,
    activation_sharding: jax.sharding.Sharding | None = None,
    kernel_mesh: KernelMesh | None = None,
  ):
    """Runs the model.

    Args:
      tokens_bt: int token ids.
      positions_bt: position of each token (defaults to 0..t-1); with a cache, token i of row b
        is written to slot positions_bt[b, i] and attends to slots <= its position.
      cache: per-layer KV caches (`LayerCache` from `init_cache`, `PagedLayerCache`, or
        `PackedPrefillCache` with `segment_ids_bt`), or None for a plain causal forward. Paged
        rows mark padding tokens with position -1.
      return_routing: also return the MoE routing trace.
      moe: MoE models: the expert-parallel path, routes to replay and an expert placement
        (`MoEInputs`); None routes with the router through the reference dispatch.
      return_hidden: return the final hidden states `[b, t, d]` (after the final norm and
        `logits_scaling`, in the compute dtype) instead of the logits, for callers that apply
        the LM head in chunks (`lm_head`, `vocab_mask`) so that `[b, t, vocab]` fp32 logits
        never exist whole.
      segment_ids_bt: packed rows (training without a cache, or a packed prefill): int id of
        the sequence each token belongs to (0, 1, ... in a row; -1 for padding, which attends
        to nothing); a token attends only to earlier-or-equal positions of its own segment,
        and `positions_bt` restart at 0 in each segment (`jaxrl.train.packing`). None: each
        row is one sequence.
      return_moe_counts: also return the (token, k) assignments of real tokens the MoE layers
        routed and dropped for capacity (`ExpertParallelConfig.capacity_factor`), summed over
        the layers.
      activation_sharding: the `[b, t, d]` residual stream's sharding, pinned after the
        embedding and after every block (the learner: rows split over its batch axes). Without
        it XLA chooses, and with weights sharded over their `embed` axis (FSDP) it chose to
        gather and all-reduce `[b, t, ...]` activations in every layer instead of gathering the
        weights (a training mesh's collectives then grow with the tokens, not the parameters;
        docs/BENCHMARKS.md, "Training meshes"). None: XLA's choice.
      kernel_mesh: where the attention kernels' operands live on a mesh (`KernelMesh`, from
        `jaxrl.sharding.kernel_mesh`: rows over the batch axes, kv heads over the heads'
        axes), so that each device runs the kernels on its own rows and heads; None on one
        device (`jaxrl.kernels.partitioning`: without it XLA gathers every kernel's operands
        onto every GPU, and a TPU refuses the program).

    Returns:
      (logits_btv in fp32, or hidden_btd with `return_hidden`; updated cache or None), plus,
      with `return_routing`, the expert ids each token was routed to, int32
      `[b, t, layers, top_k]` (None for a dense model), plus, with `return_moe_counts`,
      `{"routed": int32, "dropped": int32}` (zeros for a dense model).
    """
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    embed_vd = self.embed_vd.get_value()
    x_btd = embed_vd[tokens_bt].astype(dt)
    if cfg.scale_embeddings:  # Gemma: by sqrt(d_model), itself rounded to the compute dtype
      x_btd = x_btd * jnp.asarray(cfg.d_model**0.5, dt)
    if cfg.embedding_multiplier != 1:  # Granite
      x_btd = x_btd * jnp.asarray(cfg.embedding_multiplier, dt)
    x_btd = _pin(x_btd, activation_sharding)
    args = (x_btd, positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh)
    packed_prefill = cache is not None and isinstance(cache[0], PackedPrefillCache)
    if cfg.scan_layers and cache is None:
      x_btd, new_cache, ids_btlk, routed, dropped = self._scan_blocks(*args, cfg.num_layers)
    elif cfg.scan_layers and packed_prefill and cfg.num_layers > 1:
      x_btd, new_cache, ids_btlk, routed, dropped = self._scan_packed_prefill(cache, *args)
    else:
      x_btd, new_cache, ids_btlk, routed, dropped = self._unrolled_blocks(cache, *args)
    x_btd = self.final_norm(x_btd)
    if cfg.logits_scaling != 1:  # Granite: logits / scaling, the head being linear
      x_btd = x_btd / jnp.asarray(cfg.logits_scaling, x_btd.dtype)
    if return_hidden:
      out = x_btd, new_cache
    else:
      logits_btv = self.lm_head().logits(x_btd).astype(jnp.float32)
      logits_btv = vocab_mask(softcap(logits_btv, cfg.final_logit_softcap), cfg.vocab_limit)
      out = logits_btv, new_cache
    if return_routing:
      out = *out, ids_btlk
    if return_moe_counts:
      out = *out, {"routed": routed, "dropped": dropped}
    return out

  def _scan_packed_prefill(
    self, cache, x_btd, positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh
  ):
    """A packed prefill with its blocks but the last scanned (`_scan_blocks`), each scanned
    layer's keys and values then written to its own pool, and the last block unrolled: its
    keys and values are all that is used of it, so XLA drops its attention output and MLP,
    which a scanned block would compute (on CPU, 6-25% of the prefill). Returns what
    `_unrolled_blocks` returns."""
    cfg = self.cfg
    scanned = cfg.num_layers - 1
    kv_dtype = cache[0].k_pages_kpze.dtype
    args = (positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh)
    x_btd, kv, ids_btlk, routed, dropped = self._scan_blocks(
      x_btd, *args, scanned, kv_dtype=kv_dtype
    )
    new_cache = tuple(
      write_packed_prefill(c, k, v, positions_bt, kernel_mesh)
      for c, k, v in zip(cache[:scanned], *kv, strict=True)
    )
    x_btd, last_cache, last_ids, last_routed, last_dropped = self._unrolled_blocks(
      cache, x_btd, *args, first=scanned
    )
    if ids_btlk is not None:
      ids_btlk = jnp.concatenate([ids_btlk, last_ids], axis=2)
    return (
      x_btd, new_cache + last_cache, ids_btlk, routed + last_routed, dropped + last_dropped
    )  # fmt: skip

  def _unrolled_blocks(
    self, cache, x_btd, positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh, *,
    first=0,
  ):  # fmt: skip
    """The blocks from `first` on, one after another (passes with a cache, or `scan_layers`
    off): returns the residual stream after them, their updated caches (None without a
    cache), the expert ids each of their MoE layers routed to (`[b, t, layers, k]`, None for
    a dense model) and the routed and dropped assignments summed over them."""
    cfg = self.cfg
    new_cache, routing, routed, dropped = [], [], jnp.int32(0), jnp.int32(0)
    for i in range(first, cfg.num_layers):
      block = self.blocks[i]
      layer_cache = None if cache is None else cache[i]
      if cfg.remat and cache is None:
        # Training: keep each block's input (and what `remat_policy` names) for the backward
        # pass and recompute the rest, trading compute for activation memory that no longer
        # grows with depth.
        run = _remat_block(cfg, moe, i, kernel_mesh)
        x_btd, layer_cache, layer_routing = run(block, x_btd, positions_bt, segment_ids_bt)
      else:
        x_btd, layer_cache, layer_routing = block(
          x_btd, positions_bt, layer_cache, moe, i, segment_ids_bt, cfg.layer_window(i),
          kernel_mesh,
        )  # fmt: skip
      x_btd = _pin(x_btd, activation_sharding)
      new_cache.append(layer_cache)
      if layer_routing is not None:
        routing.append(layer_routing.ids_btk)
        routed, dropped = routed + layer_routing.routed, dropped + layer_routing.dropped
    ids_btlk = jnp.stack(routing, axis=2).astype(jnp.int32) if cfg.is_moe else None
    return x_btd, (None if cache is None else tuple(new_cache)), ids_btlk, routed, dropped

  def _scan_blocks(
    self, x_btd, positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh,
    layers: int, *, kv_dtype=None,
  ):  # fmt: skip
    """The first `layers` blocks of a pass without a cache, or of a packed prefill
    (`kv_dtype`: its pool's dtype), as one `lax.scan` (`ModelConfig.scan_layers`): returns,
    in `_unrolled_blocks`' order, the residual stream after them, a packed prefill's keys and
    values in place of caches (`[layers, b, t, k, e]` each, in `kv_dtype`, for the caller to
    write to the layers' pools; else None), the expert ids each MoE layer routed to (`[b, t,
    layers, k]`, None for a dense model) and the routed and dropped assignments summed over
    the layers.

    Their weights are stacked along a leading layer axis inside the program, in the compute
    dtype: every block parameter is cast to it where it is used (the norms' scales and the
    biases too), so the stacked copy changes no value, and it is half the size of fp32 master
    weights. Its gradient is sliced back into the layers' own.

    Layers whose sliding windows differ (Gemma 3: five local layers, then a global one) need
    the window statically: the scan's step then runs one period of the pattern, its blocks
    one after another (`_window_period`), and a last scan the layers that remain."""
    cfg = self.cfg
    args = (positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh)
    period = _window_period(cfg, layers)
    whole = layers // period * period
    parts = [(0, whole, period)] + [(whole, layers - whole, layers - whole)] * (whole < layers)
    kvs, ids, routed, dropped = [], [], jnp.int32(0), jnp.int32(0)
    for first, count, p in parts:
      x_btd, kv, part_ids, part_routed, part_dropped = self._scan_period(
        x_btd, *args, first=first, count=count, period=p, kv_dtype=kv_dtype
      )
      kvs.append(kv)
      ids.append(part_ids)
      routed, dropped = routed + part_routed, dropped + part_dropped
    cat = lambda *xs: jnp.concatenate(xs, axis=0)  # noqa: E731
    kv = None if kvs[0] is None else jax.tree.map(cat, *kvs)
    ids_lbtk = None if ids[0] is None else cat(*ids)
    ids_btlk = None if ids_lbtk is None else jnp.moveaxis(ids_lbtk, 0, 2).astype(jnp.int32)
    return x_btd, kv, ids_btlk, routed, dropped

  def _scan_period(
    self, x_btd, positions_bt, moe, segment_ids_bt, activation_sharding, kernel_mesh, *,
    first: int, count: int, period: int, kv_dtype,
  ):  # fmt: skip
    """Layers `[first, first + count)` as a scan over `count // period` steps of `period`
    blocks each; returns the residual stream, the keys and values (or None) and the expert
    ids (or None) stacked by layer (`[count, ...]`), and the routed and dropped sums."""
    cfg = self.cfg
    dt = x_btd.dtype
    graphdef, template = nnx.split(self.blocks[0])
    weights = [nnx.to_pure_dict(nnx.state(b)) for b in self.blocks[first : first + count]]
    steps = count // period
    # stacked[j]: the weights of the j-th block of every step, stacked over the steps.
    stacked = [
      jax.tree.map(lambda *xs: jnp.stack([x.astype(dt) for x in xs]), *weights[j::period])
      for j in range(period)
    ]
    windows = [cfg.layer_window(first + j) for j in range(period)]
    layer_cache = None if kv_dtype is None else PackedPrefillKeys(kv_dtype)

    def run_block(x_btd, layer, weights, window):
      state = jax.tree.map(lambda v: v, template)
      nnx.replace_by_pure_dict(state, weights)
      block = nnx.merge(graphdef, state)
      x_btd, kv, routing = block(
        x_btd, positions_bt, layer_cache, moe, layer, segment_ids_bt, window, kernel_mesh
      )
      return _pin(x_btd, activation_sharding), kv, routing

    # Training, as unrolled: keep each block's input (and what the policy names).
    if cfg.remat and kv_dtype is None:
      run_block = jax.checkpoint(
        run_block, policy=remat_policy(cfg.remat_policy), prevent_cse=False, static_argnums=(3,)
      )

    def run_step(carry, xs):
      x_btd, routed, dropped = carry
      layers_p, weights_p = xs
      kvs, ids = [], []
      for j in range(period):
        x_btd, kv, routing = run_block(x_btd, layers_p[j], weights_p[j], windows[j])
        kvs.append(kv)
        if routing is not None:
          routed, dropped = routed + routing.routed, dropped + routing.dropped
          ids.append(routing.ids_btk)
      stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
      return (x_btd, routed, dropped), (stack(kvs), stack(ids) if ids else None)

    zero = jnp.int32(0)
    layer_ids = first + jnp.arange(count, dtype=jnp.int32).reshape(steps, period)
    (x_btd, routed, dropped), (kv, ids) = jax.lax.scan(
      run_step, (x_btd, zero, zero), (layer_ids, stacked)
    )
    # [steps, period, ...] -> [count, ...]: layer first + s * period + j is row s * period + j.
    flat = lambda x: x.reshape(count, *x.shape[2:])  # noqa: E731
    kv = None if kv is None else jax.tree.map(flat, kv)
    return x_btd, kv, None if ids is None else flat(ids), routed, dropped

  def lm_head(self) -> LMHead:
    """The LM head as stored: the embedding when tied, else `lm_head_dv`."""
    if self.cfg.tie_embeddings:
      return LMHead(self.embed_vd.get_value(), vocab_major=True)
    return LMHead(self.lm_head_dv.get_value(), vocab_major=False)


def _window_period(cfg: ModelConfig, layers: int) -> int:
  """The shortest period with which the first `layers` layers repeat their sliding windows:
  1 where every layer has the same (a scan's step is one block)."""
  windows = [cfg.layer_window(i) for i in range(layers)]
  for period in range(1, layers + 1):
    if all(windows[i] == windows[i % period] for i in range(layers)):
      return period
  return max(layers, 1)


def _pin(x: jax.Array, sharding: jax.sharding.Sharding | None) -> jax.Array:
  """`x` constrained to `sharding` (`Transformer.__call__`'s `activation_sharding`), or as is."""
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


class LMHead(NamedTuple):
  """The LM head's weights in the layout they are stored in: `[vocab, d]` when `vocab_major`
  (a tied embedding), else `[d, vocab]`.

  Used in that layout, never transposed: a transposed `[d, vocab]` view of a tied embedding
  makes XLA materialise the copy and its gradient in both layouts (four extra 0.6 GB fp32
  buffers in a Qwen3-0.6B update on CPU).
  """

  weights: jax.Array
  vocab_major: bool

  def logits(self, x_btd: jax.Array) -> jax.Array:
    """`x_btd @ head` in `x_btd`'s dtype (the weights cast to it), any leading axes."""
    spec = "...d,vd->...v" if self.vocab_major else "...d,dv->...v"
    return jnp.einsum(spec, x_btd, self.weights.astype(x_btd.dtype))


MASKED_LOGIT = -1e30  # finite, so that 0 * logit stays 0 in entropies and sums


def vocab_mask(logits_btv: jax.Array, vocab_limit: int) -> jax.Array:
  """Logits of ids >= `vocab_limit` (embedding rows past the tokenizer's vocabulary) set to
  `MASKED_LOGIT`, so that no sampler picks them and no log-prob counts them; 0 keeps all."""
  if not vocab_limit or vocab_limit >= logits_btv.shape[-1]:
    return logits_btv
  ids_v = jnp.arange(logits_btv.shape[-1])
  return jnp.where(ids_v < vocab_limit, logits_btv, MASKED_LOGIT)
