"""The Hub layout of jaxrl's parameters: which Hugging Face tensors each parameter is stored
as, and how it converts (`hub_leaves`). `hf.py` reads and writes checkpoints with it.

The Hub's `nn.Linear` weights are `[out, in]` (`q_proj.weight` is `[heads * head_dim,
hidden]`), MoE experts are one tensor per expert, and Phi-3 fuses q, k and v into `qkv_proj`
and the MLP's gate and up into `gate_up_proj`; jaxrl's are `[in, out]` with heads split
(`wq_dhe` is `[d, h, e]`) and experts stacked (`[x, d, f]`). A parameter stored as rows of a
fused tensor reads its rows on load; on save `hub_arrays` joins the parts of a tensor again.
Under a partial rotation (`ModelConfig.rotary_dim`) the head dimensions of every query and key
parameter are reordered on load and back on save (`rope.partial_rotary_order`). gpt-oss stores
its experts stacked and `[x, in, out]` already, gate and up interleaved in one `gate_up_proj`
(gate in the even columns), and its released checkpoints hold them in MXFP4 (`mxfp4.py`),
which is read only: a save writes the unquantised layout.

Glossary: v vocab, d model width, h query heads, k kv heads, e head dim, f mlp width, x experts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl.model import mxfp4
from jaxrl.model.config import ModelConfig
from jaxrl.model.functional import Params
from jaxrl.model.hf_defaults import INTERLEAVED_ROPE
from jaxrl.model.rope import partial_rotary_order
from jaxrl.model.safetensors_io import TensorInfo

Path = tuple  # a parameter's keys in the params tree, e.g. ("blocks", 0, "attn", "wq_dhe")


class Leaf(NamedTuple):
  """One jaxrl parameter and the Hub tensors it is stored as.

  Attributes:
    path: the parameter's keys in the params tree.
    names: its Hub tensors, in the order `load` reads and `save` yields them.
    shapes: their Hub shapes.
    load: (read, dtype) -> the parameter on the host, where read(i) reads names[i] (and
      read(i, (a, b)) only its rows [a, b)); a view of
      what read returned where the layouts allow, else a new array in `dtype`.
    save: the parameter on the host -> its Hub tensors, in `names` order.
    join: the parts of a Hub tensor that several leaves store (in `leaves` order) -> the
      tensor; None stacks them as row blocks (`_fused`).
  """

  path: Path
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  load: Callable[[Callable[..., np.ndarray], np.dtype], np.ndarray]
  save: Callable[[np.ndarray], Iterator[np.ndarray]]
  join: Callable[[list[np.ndarray]], np.ndarray] | None = None


def _same(path: Path, name: str, shape: tuple[int, ...]) -> Leaf:
  return Leaf(path, (name,), (shape,), lambda read, dt: read(0), lambda v: iter([v]))


def _transposed(path: Path, name: str, shape: tuple[int, int]) -> Leaf:
  """Hub `nn.Linear` weights are [out, in]; ours are [in, out]."""
  return Leaf(path, (name,), (shape,), lambda read, dt: read(0).T, lambda v: iter([v.T]))


def _heads_in(path: Path, name: str, d: int, n: int, e: int) -> Leaf:
  """q/k/v projections: Hub [n * e, d] <-> ours [d, n, e]."""
  return Leaf(
    path,
    (name,),
    ((n * e, d),),
    lambda read, dt: read(0).T.reshape(d, n, e),
    lambda v: iter([v.reshape(d, n * e).T]),
  )


def _heads_out(path: Path, name: str, h: int, e: int, d: int) -> Leaf:
  """The output projection: Hub [d, h * e] <-> ours [h, e, d]."""
  return Leaf(
    path,
    (name,),
    ((d, h * e),),
    lambda read, dt: read(0).T.reshape(h, e, d),
    lambda v: iter([v.reshape(h * e, d).T]),
  )


def _per_head(path: Path, name: str, n: int, e: int) -> Leaf:
  """q/k/v biases and OLMo 2's q/k norm scales: Hub [n * e] <-> ours [n, e]."""
  return Leaf(
    path, (name,), ((n * e,),), lambda read, dt: read(0).reshape(n, e), lambda v: iter([v.ravel()])
  )


def _experts(path: Path, names: list[str], shape: tuple[int, int]) -> Leaf:
  """Per-expert Hub weights [out, in] each <-> ours stacked [x, in, out]."""
  x, (a, b) = len(names), shape

  def load(read, dt):
    out = np.empty((x, b, a), dt)
    for i in range(x):
      out[i] = read(i).T
    return out

  return Leaf(path, tuple(names), (shape,) * x, load, lambda v: (v[i].T for i in range(x)))


def _stacked_experts(path: Path, name: str, shape: tuple[int, int, int], part: slice) -> Leaf:
  """Experts stacked in one Hub tensor `[x, out, in]`, ours the rows `part` of out as `[x, in,
  out]`: Granite MoE's input_linear (gate rows first) and output_linear, and transformers 5's
  in-memory layout should a checkpoint hold it (gate_up_proj, down_proj). The parts of one
  tensor join along its rows."""
  return Leaf(
    path,
    (name,),
    (shape,),
    lambda read, dt: read(0)[:, part].transpose(0, 2, 1),
    lambda v: iter([np.asarray(v).transpose(0, 2, 1)]),
    lambda parts: np.concatenate(parts, axis=1),
  )


def _interleave(parts: list[np.ndarray]) -> np.ndarray:
  """gpt-oss's `gate_up_proj` from its gate and up parts: their last axes interleaved."""
  return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)


def _interleaved(path: Path, name: str, shape: tuple[int, ...], part: int) -> Leaf:
  """gpt-oss's gate (`part` 0) or up (1): the even or odd last-axis entries of `name`."""
  return Leaf(
    path,
    (name,),
    (shape,),
    lambda read, dt: np.ascontiguousarray(read(0)[..., part::2]),
    lambda v: iter([v]),
    _interleave,
  )


def _mxfp4_experts(path: Path, name: str, shape: tuple[int, int, int], part: slice) -> Leaf:
  """gpt-oss's released experts, `name` `[x, in, out]` stored as MXFP4 `_blocks` and
  `_scales` of `[x, out, in]` (`mxfp4.dequantize`); `part` of the out columns. Read only."""
  x, i, o = shape
  groups = i // mxfp4.GROUP
  shapes = ((x, o, groups, mxfp4.GROUP // mxfp4.VALUES_PER_BYTE), (x, o, groups))

  def save(v):
    raise AssertionError("save_pretrained writes gpt-oss's experts unquantised, never MXFP4.")

  def load(read, dt):  # only the rows (outputs) of `part` are dequantised
    return mxfp4.dequantize(read(0)[:, part], read(1)[:, part], dt)

  return Leaf(path, (name + "_blocks", name + "_scales"), shapes, load, save)


def glm_rotary_order(e: int, rotary_dim: int, order: np.ndarray | None) -> np.ndarray:
  """jaxrl's order of a GLM head's dimensions: GLM rotates the first `rotary_dim` (all: 0) in
  interleaved pairs (2i, 2i + 1); their evens then their odds are rotate-half's pairs (i, i +
  rotary_dim / 2), which `order` (`partial_rotary_order`, None for a whole head) maps on."""
  r = rotary_dim or e
  halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, e)])
  return halves if order is None else halves[order]


def _reordered(leaf: Leaf, order: np.ndarray | None) -> Leaf:
  """`leaf` with its last axis (a head's dimensions) in jaxrl's `order`, the Hub's on save."""
  if order is None:
    return leaf
  back = np.argsort(order)
  return leaf._replace(
    load=lambda read, dt: np.ascontiguousarray(leaf.load(read, dt)[..., order]),
    save=lambda v: leaf.save(np.ascontiguousarray(np.asarray(v)[..., back])),
  )


def _rows(leaf: Leaf, name: str, shape: tuple[int, ...], start: int) -> Leaf:
  """`leaf`'s one Hub tensor stored as rows `[start, start + its rows)` of tensor `name` of
  `shape`; it reads only those rows, and its save yields them, which `hub_arrays` joins with
  the others."""
  rows = (start, start + leaf.shapes[0][0])
  return Leaf(
    leaf.path, (name,), (shape,), lambda read, dt: leaf.load(lambda i: read(0, rows), dt), leaf.save
  )


def _fused(parts: list[Leaf], name: str) -> list[Leaf]:
  """`parts` (of one Hub tensor each) stored as consecutive row blocks of tensor `name`:
  Phi-3's qkv_proj and gate_up_proj."""
  rows = [leaf.shapes[0][0] for leaf in parts]
  shape = (sum(rows), *parts[0].shapes[0][1:])
  starts = np.cumsum([0, *rows[:-1]])
  return [_rows(leaf, name, shape, int(start)) for leaf, start in zip(parts, starts, strict=True)]


def _gpt_oss_layer(cfg: ModelConfig, hub: str, ours: Path, mx: bool) -> list[Leaf]:
  """gpt-oss's attention extras (the output bias, the sinks) and MoE (router and experts with
  biases; `mx`: the experts in MXFP4) of one layer."""
  x, f, d, h = cfg.num_experts, cfg.moe_mlp_dim, cfg.d_model, cfg.num_heads
  attn, moe, experts = (*ours, "attn"), (*ours, "mlp"), hub + "mlp.experts."
  leaves = [
    _same((*attn, "bo_d"), hub + "self_attn.o_proj.bias", (d,)),
    _same((*attn, "sinks_h"), hub + "self_attn.sinks", (h,)),
    _transposed((*moe, "router_dx"), hub + "mlp.router.weight", (x, d)),
    _same((*moe, "router_b_x"), hub + "mlp.router.bias", (x,)),
    _interleaved((*moe, "b_gate_xf"), experts + "gate_up_proj_bias", (x, 2 * f), 0),
    _interleaved((*moe, "b_up_xf"), experts + "gate_up_proj_bias", (x, 2 * f), 1),
    _same((*moe, "b_down_xd"), experts + "down_proj_bias", (x, d)),
  ]
  gate_up, down, gate_up_shape = experts + "gate_up_proj", experts + "down_proj", (x, d, 2 * f)
  if mx:
    return leaves + [
      _mxfp4_experts((*moe, "w_gate_xdf"), gate_up, gate_up_shape, slice(0, None, 2)),
      _mxfp4_experts((*moe, "w_up_xdf"), gate_up, gate_up_shape, slice(1, None, 2)),
      _mxfp4_experts((*moe, "w_down_xfd"), down, (x, f, d), slice(None)),
    ]
  return leaves + [
    _interleaved((*moe, "w_gate_xdf"), gate_up, gate_up_shape, 0),
    _interleaved((*moe, "w_up_xdf"), gate_up, gate_up_shape, 1),
    _same((*moe, "w_down_xfd"), down, (x, f, d)),
  ]


def hub_leaves(
  cfg: ModelConfig,
  fused_layers: frozenset[int] = frozenset(),
  fused_projections: bool = False,
  mxfp4_experts: bool = False,
  granite_moe: bool = False,
  glm: bool = False,
  interleaved_rope: bool = False,
) -> list[Leaf]:
  """Every parameter of `cfg`'s model with its Hub tensors; `fused_layers`: MoE layers whose
  experts a checkpoint holds fused; `fused_projections`: q, k, v and the MLP's gate and up as
  Phi-3 stores them (`qkv_proj`, `gate_up_proj`); `mxfp4_experts`: gpt-oss's experts in MXFP4
  (read only); `granite_moe`: Granite MoE's expert tensors (`block_sparse_moe.input_linear`,
  `output_linear`, `router.layer`); `glm`: GLM-4's norm names and fused gate/up;
  `interleaved_rope`: q and k rotated in interleaved pairs (GLM-4, ERNIE 4.5;
  `glm_rotary_order`)."""
  v, d, h, k, e = cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  order = partial_rotary_order(e, cfg.rotary_dim)
  if interleaved_rope:
    order = glm_rotary_order(e, cfg.rotary_dim, order)
  leaves = [_same(("embed_vd",), "model.embed_tokens.weight", (v, d))]
  # Pre-norm models: input_layernorm before attention, post_attention_layernorm before the
  # MLP; OLMo 2 (post-norm): post_attention_layernorm after attention, post_feedforward after;
  # Gemma (sandwich): input_layernorm and pre_feedforward before, the post ones after.
  attn_norm, mlp_norm = ("input_layernorm", "post_attention_layernorm")
  if cfg.norm_position == "post":
    attn_norm, mlp_norm = ("post_attention_layernorm", "post_feedforward_layernorm")
  if cfg.norm_position == "sandwich":  # Gemma: those two after, these two before
    attn_norm, mlp_norm = ("input_layernorm", "pre_feedforward_layernorm")
  attn_post, mlp_post = "post_attention_layernorm", "post_feedforward_layernorm"
  if glm:  # GLM-4's sandwich: its own names, post_attention_layernorm before the MLP
    attn_norm, mlp_norm = "input_layernorm", "post_attention_layernorm"
    attn_post, mlp_post = "post_self_attn_layernorm", "post_mlp_layernorm"
  for i in range(cfg.num_layers):
    hub, ours = f"model.layers.{i}.", ("blocks", i)
    attn, mlp = hub + "self_attn.", hub + "mlp."
    qkv = [
      _reordered(_heads_in((*ours, "attn", "wq_dhe"), attn + "q_proj.weight", d, h, e), order),
      _reordered(_heads_in((*ours, "attn", "wk_dke"), attn + "k_proj.weight", d, k, e), order),
      _heads_in((*ours, "attn", "wv_dke"), attn + "v_proj.weight", d, k, e),
    ]
    if fused_projections:
      qkv = _fused(qkv, attn + "qkv_proj.weight")
    leaves += [
      _same((*ours, "attn_norm", "scale"), hub + attn_norm + ".weight", (d,)),
      *qkv,
      _heads_out((*ours, "attn", "wo_hed"), attn + "o_proj.weight", h, e, d),
      _same((*ours, "mlp_norm", "scale"), hub + mlp_norm + ".weight", (d,)),
    ]
    if cfg.norm_position == "sandwich":
      leaves += [
        _same((*ours, "attn_post_norm", "scale"), hub + attn_post + ".weight", (d,)),
        _same((*ours, "mlp_post_norm", "scale"), hub + mlp_post + ".weight", (d,)),
      ]
    if cfg.qkv_bias:
      leaves += [
        _reordered(_per_head((*ours, "attn", "bq_he"), attn + "q_proj.bias", h, e), order),
        _reordered(_per_head((*ours, "attn", "bk_ke"), attn + "k_proj.bias", k, e), order),
        _per_head((*ours, "attn", "bv_ke"), attn + "v_proj.bias", k, e),
      ]
    q_norm, k_norm = (*ours, "attn", "q_norm", "scale"), (*ours, "attn", "k_norm", "scale")
    if cfg.qk_norm_across_heads:
      leaves += [
        _reordered(_per_head(q_norm, attn + "q_norm.weight", h, e), order),
        _reordered(_per_head(k_norm, attn + "k_norm.weight", k, e), order),
      ]
    elif cfg.qk_norm:
      leaves += [
        _reordered(_same(q_norm, attn + "q_norm.weight", (e,)), order),
        _reordered(_same(k_norm, attn + "k_norm.weight", (e,)), order),
      ]
    if cfg.moe_biases:  # gpt-oss
      leaves += _gpt_oss_layer(cfg, hub, ours, mxfp4_experts)
      continue
    if not cfg.is_moe:
      f = cfg.mlp_dim
      gate_up = [
        _transposed((*ours, "mlp", "w_gate_df"), mlp + "gate_proj.weight", (f, d)),
        _transposed((*ours, "mlp", "w_up_df"), mlp + "up_proj.weight", (f, d)),
      ]
      if fused_projections or glm:
        gate_up = _fused(gate_up, mlp + "gate_up_proj.weight")
      leaves += [
        *gate_up,
        _transposed((*ours, "mlp", "w_down_fd"), mlp + "down_proj.weight", (d, f)),
      ]
      continue
    x, f = cfg.num_experts, cfg.moe_mlp_dim
    if granite_moe:
      moe = hub + "block_sparse_moe."
      inputs, outputs = moe + "input_linear.weight", moe + "output_linear.weight"
      leaves += [
        _transposed((*ours, "mlp", "router_dx"), moe + "router.layer.weight", (x, d)),
        _stacked_experts((*ours, "mlp", "w_gate_xdf"), inputs, (x, 2 * f, d), slice(0, f)),
        _stacked_experts((*ours, "mlp", "w_up_xdf"), inputs, (x, 2 * f, d), slice(f, 2 * f)),
        _stacked_experts((*ours, "mlp", "w_down_xfd"), outputs, (x, d, f), slice(None)),
      ]
      continue
    # Mixtral (the MoE without q/k norms or biases) keeps its own names: block_sparse_moe,
    # w1/w3/w2.
    mixtral = not cfg.qk_norm and not cfg.qkv_bias and i not in fused_layers
    moe = hub + "block_sparse_moe." if mixtral else mlp
    leaves.append(_transposed((*ours, "mlp", "router_dx"), moe + "gate.weight", (x, d)))
    if cfg.shared_expert_dim:  # Qwen2-MoE's
      s, shared = cfg.shared_expert_dim, mlp + "shared_expert."
      leaves += [
        _transposed((*ours, "mlp", "w_shared_gate_ds"), shared + "gate_proj.weight", (s, d)),
        _transposed((*ours, "mlp", "w_shared_up_ds"), shared + "up_proj.weight", (s, d)),
        _transposed((*ours, "mlp", "w_shared_down_sd"), shared + "down_proj.weight", (d, s)),
      ]
      if cfg.shared_expert_gate:
        leaves.append(
          Leaf(
            (*ours, "mlp", "shared_gate_d"),
            (mlp + "shared_expert_gate.weight",),
            ((1, d),),
            lambda read, dt: read(0)[0],
            lambda v: iter([np.asarray(v)[None]]),
          )
        )
    if i in fused_layers:
      gate_up, down = mlp + "experts.gate_up_proj", mlp + "experts.down_proj"
      leaves += [
        _stacked_experts((*ours, "mlp", "w_gate_xdf"), gate_up, (x, 2 * f, d), slice(0, f)),
        _stacked_experts((*ours, "mlp", "w_up_xdf"), gate_up, (x, 2 * f, d), slice(f, 2 * f)),
        _stacked_experts((*ours, "mlp", "w_down_xfd"), down, (x, d, f), slice(None)),
      ]
      continue
    experts = [f"{moe}experts.{j}." for j in range(x)]
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    leaves += [
      _experts((*ours, "mlp", "w_gate_xdf"), [f"{p}{gate}.weight" for p in experts], (f, d)),
      _experts((*ours, "mlp", "w_up_xdf"), [f"{p}{up}.weight" for p in experts], (f, d)),
      _experts((*ours, "mlp", "w_down_xfd"), [f"{p}{down}.weight" for p in experts], (d, f)),
    ]
  leaves.append(_same(("final_norm", "scale"), "model.norm.weight", (d,)))
  if not cfg.tie_embeddings:
    leaves.append(_transposed(("lm_head_dv",), "lm_head.weight", (v, d)))
  return leaves


def param_paths(tree: Params) -> dict[Path, Any]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(key.key for key in path): leaf for path, leaf in flat}


def check_coverage(leaves: list[Leaf], params: Params) -> None:
  ours, mapped = set(param_paths(params)), {leaf.path for leaf in leaves}
  if ours != mapped:
    raise ValueError(
      f"The Hugging Face mapping and the model disagree: parameters without a Hub tensor "
      f"{sorted(map(str, ours - mapped))}, Hub tensors without a parameter "
      f"{sorted(map(str, mapped - ours))}. Update jaxrl/model/hf_layout.py with the model."
    )


def fused_expert_layers(cfg: ModelConfig, tensors: Mapping[str, TensorInfo]) -> frozenset[int]:
  if not cfg.is_moe:
    return frozenset()
  return frozenset(
    i for i in range(cfg.num_layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in tensors
  )


def model_type_layout(model_type: str | None) -> dict[str, bool]:
  """The `hub_leaves` options that a model type's checkpoints always take, on load and on
  save: Granite MoE's stacked experts, GLM-4's names and fused gate/up, the interleaved
  rotation of GLM-4 and ERNIE 4.5."""
  return dict(
    granite_moe=model_type == "granitemoe",
    glm=model_type == "glm4",
    interleaved_rope=model_type in INTERLEAVED_ROPE,
  )


def has_mxfp4_experts(tensors: Mapping[str, TensorInfo]) -> bool:
  """Whether a checkpoint holds gpt-oss's experts in MXFP4 (as OpenAI released them)."""
  return "model.layers.0.mlp.experts.gate_up_proj_blocks" in tensors


def has_fused_projections(tensors: Mapping[str, TensorInfo]) -> bool:
  """Whether a checkpoint stores q, k, v fused (Phi-3's `qkv_proj`)."""
  return "model.layers.0.self_attn.qkv_proj.weight" in tensors


def hub_arrays(leaves: list[Leaf], params: Params) -> Iterator[tuple[str, np.ndarray]]:
  """The Hub tensors of `params` in `leaves` order, the row blocks of a fused tensor joined;
  one parameter (or one fused tensor's) on the host at a time."""
  values = param_paths(params)
  blocks = collections.Counter(name for leaf in leaves for name in leaf.names)
  parts: list[np.ndarray] = []
  for leaf in leaves:
    value = np.asarray(jax.device_get(values[leaf.path]))
    for name, array in zip(leaf.names, leaf.save(value), strict=True):
      parts.append(array)
      if len(parts) == blocks[name]:
        join = leaf.join or (lambda p: np.concatenate(p, axis=0))
        yield name, parts[0] if len(parts) == 1 else join(parts)
        parts = []
    del value
