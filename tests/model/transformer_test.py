"""Model tests: cached decoding equals the full forward pass; presets and config checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import PRESETS, Model, ModelConfig, get_preset

VARIANTS = {
  "tiny": get_preset("tiny"),
  "qwen3-style": get_preset("tiny", qk_norm=True, tie_embeddings=False),
  "qwen2-style": get_preset("tiny", qkv_bias=True, num_kv_heads=1),
  "tiny-moe": get_preset("tiny-moe"),
  # OLMo 2: norms after each sublayer, q/k norms across heads.
  "olmo2-style": get_preset(
    "tiny", qk_norm=True, qk_norm_across_heads=True, norm_position="post", tie_embeddings=False
  ),
  "smollm3-style": get_preset("tiny", nope_layers=(1,)),  # the second layer unrotated
  "yarn": get_preset(
    "tiny", rope_scaling="yarn", rope_factor=4.0, rope_original_max_position_embeddings=8
  ),
  # Gemma 3: sandwich norms stored minus one, GeGLU, scaled embeddings, a logit scale, and a
  # window of 3 positions (shorter than the tests' rows) in layers 0, 1 and 3 of 4 with their
  # own RoPE base (the scan's step is a period of three layers, then one more).
  "gemma3-style": get_preset(
    "tiny",
    num_layers=4,
    qk_norm=True,
    norm_position="sandwich",
    norm_scale_plus_one=True,
    mlp_activation="gelu_tanh",
    scale_embeddings=True,
    attention_logit_scale=0.1,
    sliding_window=3,
    sliding_layers=(0, 1, 3),
    local_rope_theta=100.0,
    tie_embeddings=False,
  ),  # fmt: skip
  # Gemma 2: Gemma 3's norms without q/k norms, every other layer windowed, logits softcapped
  # low enough (attention 1.5, final 3) that most are capped.
  "gemma2-style": get_preset(
    "tiny",
    num_layers=3,
    norm_position="sandwich",
    norm_scale_plus_one=True,
    mlp_activation="gelu_tanh",
    scale_embeddings=True,
    sliding_window=3,
    sliding_layers=(0, 2),
    attention_logit_softcap=1.5,
    final_logit_softcap=3.0,
    tie_embeddings=False,
  ),  # fmt: skip
  # gpt-oss: attention sinks, q/k/v biases, every other layer windowed.
  "sinks": get_preset(
    "tiny",
    num_layers=3,
    attention_sinks=True,
    qkv_bias=True,
    sliding_window=3,
    sliding_layers=(0, 2),
    tie_embeddings=False,
  ),  # fmt: skip
  # The rest of gpt-oss: the output bias, MoE with biases and the clamped SwiGLU (clamped at
  # 0.5, so that it binds); and Qwen2-MoE's gated shared expert.
  "gpt-oss-style": get_preset(
    "tiny-moe",
    num_layers=2,
    attention_sinks=True,
    qkv_bias=True,
    attention_out_bias=True,
    moe_biases=True,
    mlp_activation="clamped_swiglu",
    swiglu_limit=0.5,
    sliding_window=3,
    sliding_layers=(0,),
    tie_embeddings=False,
  ),  # fmt: skip
  "shared-expert": get_preset(
    "tiny-moe", num_layers=2, shared_expert_dim=48, shared_expert_gate=True, qkv_bias=True
  ),
}


def _random_params(model, seed):
  # Random biases and norm scales too, so the options are really exercised.
  params = model.init(seed)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  return jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_kv_cache_decode_matches_full_forward(name):
  cfg = VARIANTS[name]
  model = Model(cfg)
  params = _random_params(model, np.random.randint(1 << 16))
  rng = np.random.default_rng()
  batch, prompt_len, total = 3, 5, 11
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, total)), jnp.int32)
  full_logits, _ = jax.jit(model.apply)(params, tokens)
  # Decoding attends over the cache instead of the whole sequence: other sums, other orders.
  terms = tolerance.model_terms(cfg)
  scale = np.abs(np.asarray(full_logits)).max()

  # Ragged prompts: row b has prompt_len - b real tokens, then decodes one token at a time.
  cache = model.init_cache(batch, 16)
  step = jax.jit(model.apply)
  logits, cache = step(params, tokens[:, :prompt_len], None, cache)
  lens = np.array([prompt_len - b for b in range(batch)])
  for b in range(batch):
    want = full_logits[b, : lens[b]]
    tolerance.assert_close(logits[b, : lens[b]], want, n=terms, scale=scale)
  for _ in range(total - prompt_len):
    pos = jnp.asarray(lens)[:, None]
    tok = tokens[jnp.arange(batch), lens][:, None]
    logits, cache = step(params, tok, pos, cache)
    for b in range(batch):
      want = full_logits[b, lens[b]]
      tolerance.assert_close(logits[b, 0], want, n=terms, scale=scale, err_msg=f"row {b}")
    lens = lens + 1


# MoE options: q/k norm and biases; gpt-oss's (router and expert biases, the clamped SwiGLU,
# sinks, the output bias); Qwen2-MoE's gated shared expert.
_OPTION_MOES = [
  dict(qk_norm=True, qkv_bias=True, tie_embeddings=False),
  dict(moe_biases=True, mlp_activation="clamped_swiglu", attention_sinks=True,
       attention_out_bias=True, qkv_bias=True),
  dict(shared_expert_dim=48, shared_expert_gate=True, qkv_bias=True),
]  # fmt: skip


@pytest.mark.parametrize("options", _OPTION_MOES)
def test_logical_axes_cover_every_param_and_num_params_counts_them(options):
  cfg = get_preset("tiny-moe", **options)
  model = Model(cfg)
  shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
  axes = model.logical_axes
  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  flat_shapes = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
  assert len(flat_axes) == len(flat_shapes)
  for a, s in zip(flat_axes, flat_shapes, strict=True):
    assert len(a) == len(s)
  assert sum(int(np.prod(s)) for s in flat_shapes) == cfg.num_params()


# The two largest presets take 5-13 s each to build abstractly (64 and 48 layers) and are
# `slow`: qwen3-8b has qwen3-32b's structure (untied, qk-norm), and the MoE count is
# tiny-moe's formula.
_SLOW_PRESETS = ("qwen3-32b", "qwen3-30b-a3b")


@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_PRESETS else n for n in sorted(PRESETS)],
)
def test_presets_param_count(name):
  cfg = PRESETS[name]
  model = Model(cfg)
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract_params()))
  assert count == cfg.num_params()


def test_qwen3_preset_shapes():
  cfg = PRESETS["qwen3-0.6b"]
  assert (
    cfg.num_layers,
    cfg.d_model,
    cfg.mlp_dim,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.vocab_size,
  ) == (28, 1024, 3072, 16, 8, 128, 151936)
  assert cfg.qk_norm and cfg.tie_embeddings


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(num_heads=6, num_kv_heads=4), "multiple of model.num_kv_heads"),
    (dict(head_dim=31), "even"),
    (dict(num_experts=4, experts_per_token=5, moe_mlp_dim=8), "experts_per_token"),
    (dict(dtype="float16"), "model.dtype"),
    (dict(attention="cudnn"), "model.attention='cudnn' computes in bfloat16"),
  ],
)
def test_config_errors(bad, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(ModelConfig(), **bad)


def test_unknown_preset():
  with pytest.raises(ValueError, match="known presets"):
    get_preset("gpt5")


# "remat" is `slow`: remat_policy_test takes every policy's gradients on packed rows.
@pytest.mark.parametrize(
  "name",
  [
    "tiny",
    "tiny-moe",
    "olmo2-style",
    "smollm3-style",
    "gemma3-style",
    "gemma2-style",
    "sinks",
    "gpt-oss-style",
    "shared-expert",
    pytest.param("remat", marks=pytest.mark.slow),
  ],
)
def test_packed_row_logits_equal_each_sequence_run_alone(name):
  """Segment ids keep packed sequences apart: each token attends only to its own segment's
  earlier positions, which restart at 0, so its logits are the ones its sequence gives alone."""
  cfg = dataclasses.replace(VARIANTS["tiny"], remat=True) if name == "remat" else VARIANTS[name]
  model = Model(cfg)
  params = _random_params(model, np.random.randint(1 << 16))
  rng = np.random.default_rng()
  lengths = [5, 9, 1, 4]
  seqs = [rng.integers(0, cfg.vocab_size, n) for n in lengths]
  padding = 3
  tokens = np.concatenate([*seqs, rng.integers(0, cfg.vocab_size, padding)])
  positions = np.concatenate([np.arange(n) for n in [*lengths, padding]])
  segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [[-1] * padding])
  # Two rows: the packed one, and the same sequences in another order.
  order = np.concatenate([np.arange(sum(lengths[:2]), sum(lengths)), np.arange(sum(lengths[:2]))])
  order = np.concatenate([order, np.arange(sum(lengths), tokens.size)])
  rows = lambda x: jnp.asarray(np.stack([x, x[order]]), jnp.int32)  # noqa: E731
  packed, _ = jax.jit(model.apply)(
    params, rows(tokens), rows(positions), segment_ids_bt=rows(segments)
  )
  scale = terms = None
  for i, seq in enumerate(seqs):
    alone, _ = jax.jit(model.apply)(params, jnp.asarray(seq[None], jnp.int32))
    scale = np.abs(np.asarray(alone)).max()
    terms = tolerance.model_terms(cfg)
    where = segments == i
    tolerance.assert_close(packed[0][where], alone[0], n=terms, scale=scale, err_msg=f"seq {i}")
    tolerance.assert_close(packed[1][where[order]], alone[0], n=terms, scale=scale)
  with pytest.raises(ValueError, match="without a KV cache"):
    model.apply(params, rows(tokens), None, model.init_cache(2, 32), segment_ids_bt=rows(segments))


@pytest.mark.parametrize(
  "name,packed",
  [
    ("tiny", False),
    ("tiny", True),
    ("gemma3-style", True),
    ("gemma2-style", True),
    ("sinks", True),
    ("gpt-oss-style", True),
  ],
)
def test_flash_attention_gives_the_dense_logits_and_gradients(name, packed):
  """`model.attention="flash"` runs the blockwise kernel where training has no cache: the same
  logits and parameter gradients as dense attention, plain rows and packed rows alike, sliding
  windows and softcapped logits too."""
  cfg = VARIANTS[name]
  if cfg.mlp_activation == "clamped_swiglu":
    # gpt-oss-style: a clamp that never binds here. Where it binds, a pre-activation within
    # rounding of its kink (the gradient jumps between 0 and 1) falls on either side on the two
    # attentions' paths, and one gradient differs by far more than rounding. Of the about
    # 650,000 gate and up values here, 12 draws of 12 put one within 1e-5 of the clamp, and a
    # full run failed so (2026-12-07: 57 of 64 elements of one gradient apart). The clamp's
    # gradient is checked in tests/model/moe_test.py, on draws clear of the kink.
    cfg = dataclasses.replace(cfg, swiglu_limit=1e4)
  dense_model = Model(dataclasses.replace(cfg, max_seq_len=96))
  flash_model = Model(dataclasses.replace(dense_model.config, attention="flash"))
  params = _random_params(dense_model, np.random.randint(1 << 16))
  rng = np.random.default_rng()
  cfg = dense_model.config
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 80)), jnp.int32)
  positions = segments = None
  if packed:
    lengths = [30, 17, 25, 8]  # and 80 - 80: no padding in row 0; row 1 pads its tail
    positions = np.concatenate([np.arange(n) for n in lengths])
    segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    positions = jnp.asarray(np.stack([positions, positions]), jnp.int32)
    segments = jnp.asarray(np.stack([segments, np.where(segments == 3, -1, segments)]), jnp.int32)

  def loss(model, p):
    logits, _ = model.apply(p, tokens, positions, segment_ids_bt=segments)
    return jnp.sum(jnp.tanh(logits[..., :8])), logits

  (_, want), grads_want = jax.jit(jax.value_and_grad(lambda p: loss(dense_model, p), has_aux=True))(
    params
  )
  (_, got), grads_got = jax.jit(jax.value_and_grad(lambda p: loss(flash_model, p), has_aux=True))(
    params
  )
  terms = tolerance.model_terms(cfg)
  tolerance.assert_close(got, want, n=terms, scale=float(np.abs(np.asarray(want)).max()))
  for g, w in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want), strict=True):
    scale = float(np.abs(np.asarray(w)).max()) + 1e-30
    tolerance.assert_close(g, w, n=terms * 8, scale=scale)
  with pytest.raises(ValueError, match="model.attention"):
    ModelConfig(attention="paged")


def test_cudnn_attention_runs_in_every_layer_without_a_cache(monkeypatch):
  """`model.attention="cudnn"` sends each layer's attention without a cache to cuDNN (traced,
  not run: jax's cuDNN version and GPU checks stubbed; on a GPU `tests/kernels/
  flash_attention_cudnn_test.py` runs it), packed rows included; decoding with a cache does not
  use it."""
  from jaxrl.kernels.flash_attention import api, cudnn

  api._run_cudnn.clear_cache()  # a stand-in's trace, or the stubs' below after this test
  monkeypatch.setattr(cudnn._cudnn, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn._cudnn, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(cudnn._cudnn, "is_cuda_compute_capability_equal", lambda c: False)
  # Unrolled, so that every layer's call shows (scanned, the one block is checked below).
  cfg = dataclasses.replace(
    VARIANTS["tiny"], dtype="bfloat16", attention="cudnn", scan_layers=False
  )
  model = Model(cfg)
  params = model.init(0)
  tokens = jnp.zeros((2, 16), jnp.int32)
  positions = jnp.asarray(np.tile(np.r_[np.arange(10), np.arange(6)], (2, 1)), jnp.int32)
  segments = jnp.asarray(np.tile(np.r_[np.zeros(10), np.ones(6)], (2, 1)), jnp.int32)

  def cudnn_calls(fn, *args):
    def count(jaxpr):
      return sum(
        (eqn.primitive.name in cudnn.CUDNN_FORWARD_PRIMITIVES)
        + sum(count(sub) for sub in jax.core.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
      )

    return count(jax.make_jaxpr(fn)(*args).jaxpr)

  packed = lambda p: model.apply(p, tokens, positions, segment_ids_bt=segments)[0]  # noqa: E731
  assert cudnn_calls(packed, params) == cfg.num_layers
  assert cudnn_calls(lambda p: model.apply(p, tokens)[0], params) == cfg.num_layers
  cache = model.init_cache(2, 32)
  assert cudnn_calls(lambda p: model.apply(p, tokens, None, cache)[0], params) == 0
  scanned = Model(dataclasses.replace(cfg, scan_layers=True))
  assert cudnn_calls(lambda p: scanned.apply(p, tokens)[0], params) == 1
  api._run_cudnn.clear_cache()


def test_attention_sinks_join_the_softmax_in_every_path():
  """Sinks at -1e9 take no weight: the logits are those of the model without sinks (the same
  other parameters). At other values they change the logits, and they get gradients. (Their
  paths agree: cached decoding, packed rows and flash attention in the tests above.)"""
  cfg = VARIANTS["sinks"]
  model, plain_model = Model(cfg), Model(dataclasses.replace(cfg, attention_sinks=False))
  params = _random_params(model, 3)
  key = jax.tree_util.keystr
  flat = {key(path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
  sinks = {k for k in flat if "sinks_h" in k}
  assert len(sinks) == cfg.num_layers
  plain_leaves, treedef = jax.tree_util.tree_flatten_with_path(plain_model.init(0))
  assert {key(path) for path, _ in plain_leaves} == set(flat) - sinks
  plain_params = jax.tree_util.tree_unflatten(treedef, [flat[key(p)] for p, _ in plain_leaves])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
  want, _ = jax.jit(plain_model.apply)(plain_params, tokens)
  off = jax.tree_util.tree_map_with_path(
    lambda p, x: jnp.full_like(x, -1e9) if key(p) in sinks else x, params
  )
  terms, scale = tolerance.model_terms(cfg), float(np.abs(np.asarray(want)).max())
  tolerance.assert_close(jax.jit(model.apply)(off, tokens)[0], want, n=terms, scale=scale)
  with_sinks, _ = jax.jit(model.apply)(params, tokens)
  assert np.max(np.abs(np.asarray(with_sinks) - np.asarray(want))) > 1e-2 * scale
  grads = jax.grad(lambda p: jnp.sum(jnp.tanh(model.apply(p, tokens)[0][..., :8])))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    if key(path) in sinks:
      assert np.all(np.abs(np.asarray(g)) > 0), key(path)
