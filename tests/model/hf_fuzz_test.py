"""Random Hugging Face configurations of every architecture jaxrl reads: loaded, they give
transformers' logits (also on a mesh), greedy tokens and log-probs (in the learner's packed
rows); saved, with and without their source, transformers and jaxrl read back the same model.

`hf_test.py` checks one tiny configuration of each architecture. A user's checkpoint differs in
its shapes and options, so each run here draws them: widths, heads and KV heads (multi-query to
multi-head), head widths apart from `hidden_size / heads`, layers, an odd vocabulary, tied or
untied embeddings, RoPE bases and scalings (linear, llama3, YaRN with its options, partial
rotations), sliding windows and which layers have them, layers without RoPE, experts, top-k and
renormalisation, shared experts, soft-caps and multipliers; then sequences that cross the
windows and the scalings' original contexts.

A failing run names its seed and configuration: `JAXRL_HF_SEED=<seed>` replays it.
"""

import dataclasses
import json
import math
import os
import pathlib

import jax
import numpy as np
import pytest
import torch
from helpers import hf_checkpoints as hc
from helpers import tolerance

from jaxrl.model import (
  ExpertParallel,
  MoEInputs,
  config_from_hf,
  load_pretrained,
  save_pretrained,
)
from jaxrl.sharding import TRAIN_RULES, make_mesh, tree_shardings
from jaxrl.train import Learner, LossConfig, OptimizerConfig, TrainBatch

torch.set_num_threads(1)

# Architectures whose config.json names the head width (others: hidden_size / heads).
HEAD_DIM_KEYED = {
  "llama", "mistral", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "seed_oss", "glm4",
  "ernie4_5", "gpt_oss",
}  # fmt: skip
# The key of the number of experts.
EXPERTS_KEY = {
  "qwen3_moe": "num_experts",
  "qwen2_moe": "num_experts",
  "olmoe": "num_experts",
  "mixtral": "num_local_experts",
  "granitemoe": "num_local_experts",
  "gpt_oss": "num_local_experts",
}
# Whose experts' width is `moe_intermediate_size` (others: `intermediate_size`).
MOE_WIDTH_KEYED = {"qwen3_moe", "qwen2_moe"}
NORM_TOPK_KEYED = {"qwen3_moe", "qwen2_moe", "olmoe"}
# Where every layer slides when config.json has a window.
WINDOW_EVERYWHERE = {"mistral", "mixtral", "phi3"}
# Where `layer_types` says which layers slide.
LAYER_TYPED = {"gemma2", "gemma3_text", "olmo3", "exaone4", "gpt_oss"}
# A RoPE per layer type (full and sliding layers).
ROPE_PER_LAYER_TYPE = {"gemma3_text", "olmo3"}
# Whose RoPE config jaxrl reads as one for every layer (per-layer or fixed ones aside).
FLAT_ROPE = set(hc.ARCHS) - ROPE_PER_LAYER_TYPE - {"gpt_oss"}


def _choice(rng, options):
  return options[int(rng.integers(len(options)))]


def _rope_scaling(rng, theta: float, *, max_positions: int) -> dict:
  """A RoPE parameters dict: plain, linear, llama3 or YaRN (with or without its options)."""
  kind = _choice(rng, ["default", "default", "linear", "llama3", "yarn"])
  original = int(_choice(rng, [16, 32, 64]))
  factor = float(_choice(rng, [2.0, 4.0, 8.0]))
  out = {"rope_type": kind, "rope_theta": theta}
  if kind == "linear":
    out["factor"] = factor
  elif kind == "llama3":
    out |= dict(
      factor=factor,
      low_freq_factor=float(_choice(rng, [1.0, 2.0])),
      high_freq_factor=float(_choice(rng, [4.0, 8.0])),
      original_max_position_embeddings=original,
    )
  elif kind == "yarn":
    factor = min(factor, max_positions / original)
    out |= dict(factor=factor, original_max_position_embeddings=original)
    if rng.random() < 0.5:
      out |= dict(
        beta_fast=float(_choice(rng, [16.0, 32.0])), beta_slow=float(_choice(rng, [1.0, 2.0]))
      )
    if rng.random() < 0.3:
      out["attention_factor"] = float(_choice(rng, [0.8, 1.2]))
  return out


def draw(rng) -> tuple[str, bool, dict, int]:
  """(architecture, tied, transformers config overrides, sequence length) of one run."""
  arch = _choice(rng, hc.ARCHS)
  heads = int(_choice(rng, [2, 4, 6, 8]))
  kv_heads = int(_choice(rng, [k for k in range(1, heads + 1) if heads % k == 0]))
  layers = int(rng.integers(1, 5))
  ov: dict = dict(
    num_attention_heads=heads,
    num_key_value_heads=kv_heads,
    num_hidden_layers=layers,
    vocab_size=int(_choice(rng, [509, 512, 640])),
    intermediate_size=int(_choice(rng, [24, 40, 96])),
    rms_norm_eps=float(_choice(rng, [1e-6, 1e-5])),
  )
  # Head widths: a multiple of 8, so that a partial rotation (1/2 or 3/4) stays even.
  head_dim = int(_choice(rng, [8, 16, 24, 32]))
  if arch in HEAD_DIM_KEYED:  # transformers checks that the heads divide hidden_size
    ov["head_dim"] = head_dim
    ov["hidden_size"] = heads * int(_choice(rng, [4, 8, 12]))
  else:
    ov["hidden_size"] = heads * head_dim
  theta = float(_choice(rng, [1e3, 1e4, 5e5, 1e6]))
  max_positions = 512
  length = int(_choice(rng, [40, 100, 160]))
  if arch == "phi3":  # plain or LongRoPE (transformers' Phi-3 takes no other scaling)
    partial = float(_choice(rng, [0.5, 0.75, 1.0]))
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    if rng.random() < 0.5:
      pairs = int(head_dim * partial) // 2
      factors = lambda: [float(f) for f in rng.uniform(1.0, 8.0, pairs)]  # noqa: E731
      rope |= dict(rope_type="longrope", short_factor=factors(), long_factor=factors())
      # Past the original context transformers rotates every position with the long factors
      # and jaxrl each with its own (`jaxrl/model/rope.py`): compared within it.
      ov["original_max_position_embeddings"] = length = 64
    ov["rope_parameters"] = rope
  elif arch in FLAT_ROPE:
    rope = _rope_scaling(rng, theta, max_positions=max_positions)
    if rope["rope_type"] == "yarn" and "head_dim" not in ov:  # transformers' YaRN reads it
      ov["head_dim"] = head_dim
    if arch == "glm4":
      rope["partial_rotary_factor"] = float(_choice(rng, [0.5, 0.75, 1.0]))
    ov["rope_parameters"] = rope
  elif arch in ROPE_PER_LAYER_TYPE:
    full = _rope_scaling(rng, theta, max_positions=max_positions)
    local = {"rope_type": "default", "rope_theta": float(_choice(rng, [1e3, 1e4]))}
    ov["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
  elif arch == "gpt_oss":
    rope = dict(hc.hf_config(arch).rope_parameters, rope_theta=theta)
    rope["factor"] = float(_choice(rng, [2.0, 4.0]))
    ov["rope_parameters"] = rope
  window = int(_choice(rng, [8, 16, 40]))
  if arch in WINDOW_EVERYWHERE:
    ov["sliding_window"] = _choice(rng, [None, window])
  if arch in LAYER_TYPED:
    ov["sliding_window"] = window
    types = ["sliding_attention", "full_attention"]
    ov["layer_types"] = [_choice(rng, types) for _ in range(layers)]
    if arch != "olmo3" and "sliding_attention" not in ov["layer_types"]:
      # Without one, transformers' Gemma and gpt-oss masks fail, and EXAONE 4 would have no
      # layer with RoPE (refused): a model of these kinds has sliding layers.
      ov["layer_types"][int(rng.integers(layers))] = "sliding_attention"
  if arch == "smollm3":
    ov["no_rope_layers"] = [int(rng.integers(2)) for _ in range(layers)]
  if arch in EXPERTS_KEY:
    experts = int(_choice(rng, [4, 8, 16]))
    ov[EXPERTS_KEY[arch]] = experts
    ov["num_experts_per_tok"] = int(rng.integers(1, min(4, experts) + 1))
    width = int(_choice(rng, [16, 24, 40]))
    ov["moe_intermediate_size" if arch in MOE_WIDTH_KEYED else "intermediate_size"] = width
    if arch in NORM_TOPK_KEYED:
      ov["norm_topk_prob"] = bool(rng.integers(2))
    if arch == "qwen2_moe":
      ov["shared_expert_intermediate_size"] = int(_choice(rng, [16, 48]))
    if arch == "gpt_oss":
      ov["swiglu_limit"] = float(_choice(rng, [1.5, 7.0]))
  if arch in ("gemma2", "gemma3_text"):
    ov["query_pre_attn_scalar"] = int(_choice(rng, [head_dim, 24, 100]))
    ov["final_logit_softcapping"] = _choice(rng, [None, 5.0, 30.0])
    if arch == "gemma2":
      ov["attn_logit_softcapping"] = _choice(rng, [None, 2.0, 50.0])
  if arch in ("granite", "granitemoe"):  # around Granite 3's (12, 0.22, 1 / 128, 8)
    ov["embedding_multiplier"] = float(rng.uniform(1.0, 12.0))
    ov["residual_multiplier"] = float(rng.uniform(0.1, 1.0))
    ov["attention_multiplier"] = float(rng.uniform(0.5, 2.0) / head_dim)
    ov["logits_scaling"] = float(rng.uniform(1.0, 16.0))
  return arch, bool(rng.integers(2)), ov, length


def _tokens(rng, vocab: int, length: int) -> np.ndarray:
  return rng.integers(0, vocab, (2, length)).astype(np.int32)


def check(seed: int, tmp_path: pathlib.Path) -> None:
  """One random configuration: load, compare, save, reload, compare."""
  rng = np.random.default_rng(seed)
  arch, tied, overrides, length = draw(rng)
  try:
    run(rng, arch, tied, overrides, length, tmp_path)
  except BaseException as e:
    e.add_note(
      f"JAXRL_HF_SEED={seed} replays this run: {arch}, tied={tied}, length {length}, "
      f"overrides {json.dumps(overrides)}"
    )
    raise


def run(rng, arch: str, tied: bool, overrides: dict, length: int, tmp_path) -> None:
  source = tmp_path / "source"
  # Stored in bfloat16 or float32 (both read as float32, the same values), in one file or
  # shards with an index.
  hc.write_checkpoint(
    source, arch, tied=tied, seed=int(rng.integers(1 << 16)),
    dtype=_choice(rng, ["float32", "bfloat16"]), max_shard_size=_choice(rng, [None, "40KB"]),
    **overrides,
  )  # fmt: skip
  reference = hc.load_model(source)
  vocab = overrides["vocab_size"]
  # A token at a router tie may take either expert in float32: such draws are redrawn.
  tokens, decisive = hc.decisive_tokens(reference, lambda: _tokens(rng, vocab, length))
  if not decisive:
    pytest.skip("every draw of tokens met a router tie")  # not seen; a bug would not skip
  want = hc.logits(reference, tokens)
  model, params = load_pretrained(source, dtype="float32")
  cfg = model.config
  assert cfg.tie_embeddings == tied and ("lm_head_dv" in params) == (not tied)
  got = hc.jaxrl_logits(model, params, tokens)
  tolerance.assert_close(got, want, n=tolerance.model_terms(cfg), err_msg="loaded logits")

  save_pretrained(model, params, tmp_path / "saved", source=source)
  saved = json.loads((tmp_path / "saved" / "config.json").read_text())
  assert config_from_hf(saved) == cfg
  reloaded = hc.load_model(tmp_path / "saved")
  assert type(reloaded).__name__ == type(reference).__name__
  assert hc.rel_err(hc.logits(reloaded, tokens), want) < 1e-6

  save_pretrained(model, params, tmp_path / "bare")  # without its source: a config of our own
  bare = config_from_hf(json.loads((tmp_path / "bare" / "config.json").read_text()))
  assert bare == cfg, {  # the fields that differ
    f.name: (getattr(bare, f.name), getattr(cfg, f.name))
    for f in dataclasses.fields(cfg)
    if getattr(bare, f.name) != getattr(cfg, f.name)
  }
  got = hc.logits(hc.load_model(tmp_path / "bare"), tokens)
  tolerance.assert_close(got, want, n=tolerance.model_terms(cfg), err_msg="bare save's logits")
  on_a_mesh(rng, source, cfg, tokens, want)
  greedy(rng, source, reference, vocab)
  learner_logprobs(rng, source, tokens, want)


# Meshes of the 8 test devices a checkpoint is loaded onto (MoE models: also expert axes).
MESHES = ({"fsdp": 4, "tensor": 2}, {"fsdp": 2, "tensor": 4}, {"fsdp": 8}, {"tensor": 2})
MOE_MESHES = ({"expert": 2, "fsdp": 4}, {"expert": 4, "tensor": 2}, {"expert": 8})


def on_a_mesh(rng, source, cfg, tokens, want) -> None:
  """Loaded straight into the training sharding of a random mesh, the model gives the same
  logits (MoE on an expert axis: through the expert-parallel layer); a mesh whose axes do not
  divide a dimension is refused, naming it."""
  shape = _choice(rng, MESHES + (MOE_MESHES if cfg.is_moe else ()))
  mesh = make_mesh(jax.devices()[: math.prod(shape.values())], shape)
  try:
    model, params = load_pretrained(source, dtype="float32", mesh=mesh)
  except ValueError as e:
    assert "not divisible by" in str(e) and "Use a mesh whose" in str(e), e
    return
  want_shardings = tree_shardings(model.logical_axes, mesh, TRAIN_RULES, model.abstract_params())
  for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want_shardings), strict=True):
    assert got.sharding == expected
  kwargs = {}
  if cfg.is_moe and "expert" in shape:
    kwargs["moe"] = MoEInputs(expert_parallel=ExpertParallel(mesh))
  got = hc.jaxrl_logits(model, params, tokens, **kwargs)
  tolerance.assert_close(got, want, n=tolerance.model_terms(cfg), err_msg=f"logits on {shape}")


def greedy(rng, source, reference, vocab: int, new_tokens: int = 12) -> None:
  """The paged engine's greedy continuations of two prompts (one longer than a 32-slot page)
  are transformers', up to the first step whose best two logits are within rounding of each
  other (where either is right and the two may part)."""
  prompts = [rng.integers(3, vocab, n).tolist() for n in (int(rng.integers(2, 9)), 45)]
  got = hc.paged_greedy(source, prompts, new_tokens)
  for prompt, tokens in zip(prompts, got, strict=True):
    want = hc.greedy(reference, prompt, new_tokens)
    logits = hc.logits(reference, np.asarray([prompt + want]))[0, len(prompt) - 1 : -1]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    close = np.flatnonzero(top2[:, 1] - top2[:, 0] < 1e-4 * np.abs(logits).max())
    agree = close[0] if len(close) else new_tokens
    assert tokens[:agree] == want[:agree], (prompt, tokens, want)


def learner_logprobs(rng, source, tokens, want) -> None:
  """The learner's log-probs of packed sequences (prefixes of the rows `want` scores, of
  random lengths and prompts, some longer than the packed rows) are transformers'."""
  model, params = load_pretrained(source, dtype="float32")
  learner = Learner(
    model,
    make_mesh(jax.devices()[:2], {"fsdp": 2}),
    TRAIN_RULES,
    loss=LossConfig(proximal="recompute"),
    optimizer=OptimizerConfig(),
    updates_per_step=1,
    micro_batch_size=2,
    temperature=1.0,
    params=params,
    pack_length=int(_choice(rng, [32, 64, 128])),
  )
  length = tokens.shape[1]
  rows = rng.integers(0, 2, 5)
  ends = rng.integers(2, length + 1, 5)
  tokens_bt = np.zeros((5, int(ends.max())), np.int32)
  mask_bt = np.zeros((5, int(ends.max()) - 1), np.float32)
  expected = np.zeros_like(mask_bt)
  logp = np.asarray(jax.nn.log_softmax(want, axis=-1))
  for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
    tokens_bt[i, :end] = tokens[row, :end]
    prompt = int(rng.integers(1, end))
    mask_bt[i, prompt - 1 : end - 1] = 1.0
    targets = tokens[row, 1:end]
    expected[i, : end - 1] = np.take_along_axis(logp[row, : end - 1], targets[:, None], -1)[:, 0]
  batch = TrainBatch(tokens_bt, mask_bt, np.zeros_like(mask_bt), np.zeros(5, np.float32))
  got = learner.proximal_logprobs(batch)
  tolerance.assert_close(
    got * mask_bt, expected * mask_bt, n=tolerance.model_terms(model.config),
    scale=np.abs(want).max(), err_msg=f"learner log-probs (rows of {learner.pack_length})",
  )  # fmt: skip


def _seed() -> int:
  return int(os.environ.get("JAXRL_HF_SEED") or np.random.default_rng().integers(1 << 31))


def test_a_random_configuration_loads_and_saves_as_transformers_reads_it(tmp_path):
  check(_seed(), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("run_index", range(12))
def test_random_configurations(tmp_path, run_index):
  check(_seed(), tmp_path)
