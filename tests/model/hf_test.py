"""Hugging Face checkpoints in and out: jaxrl's logits and greedy tokens equal transformers' for
every architecture of `helpers.hf_checkpoints.ARCHS`, tied and untied; save_pretrained writes
what transformers loads back; sharded files, meshes and bf16 (errors, each naming its file and
tensor or key: hf_errors_test.py; config.json alone: hf_config_test.py)."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from helpers import hf_checkpoints as hc
from helpers import tolerance
from safetensors.numpy import load_file, save_file

from jaxrl.model import (
  ExpertParallel,
  Model,
  ModelConfig,
  MoEInputs,
  config_from_hf,
  load_pretrained,
  save_pretrained,
)
from jaxrl.sharding import STAGE_RULES, make_mesh, tree_shardings

torch.set_num_threads(1)

SEQ = 256
# (arch, tied, transformers config overrides): every architecture tied and untied, Qwen3-MoE
# with and without renormalised top-k weights.
ARCHS_TIED_AND_UNTIED = ("llama", "qwen2", "qwen3", "smollm3", "olmo2", "gemma3_text", "gemma2")
CASES = [(arch, tied, {}) for arch in ARCHS_TIED_AND_UNTIED for tied in (False, True)] + [
  ("mistral", False, {}),
  ("qwen3_moe", False, {"norm_topk_prob": True}),
  ("qwen3_moe", True, {"norm_topk_prob": False}),
  ("qwen3_moe", False, {"norm_topk_prob": False}),
  ("olmoe", False, {}),
  ("phi3", False, {}),
  ("mixtral", False, {}),
  ("granite", False, {}),
  ("granitemoe", False, {}),
  ("qwen2_moe", False, {}),
  ("olmo3", False, {}),
  ("seed_oss", False, {}),
  ("exaone4", False, {}),
  ("glm4", False, {}),
  # YaRN on GLM-4's half-rotated heads: the scaling's ramp spans the rotated width.
  (
    "glm4",
    False,
    {
      "rope_parameters": dict(
        rope_type="yarn",
        rope_theta=1e4,
        factor=4.0,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
      )
    },
  ),
  ("ernie4_5", False, {}),
  ("ernie4_5", True, {}),
  ("gpt_oss", False, {}),
]


def _case_id(case):
  arch, tied, overrides = case
  norm = {True: "-norm", False: "-raw"}.get(overrides.get("norm_topk_prob"), "")
  rope = overrides.get("rope_parameters", {}).get("rope_type", "")
  return f"{arch}{norm}{rope and '-' + rope}-{'tied' if tied else 'untied'}"


def _tokens(rng, batch=2, length=SEQ):
  return rng.integers(0, hc.VOCAB_SIZE, (batch, length)).astype(np.int32)


def _decisive_tokens(reference, **shape):
  """Random tokens no MoE router of `reference` is near a tie on (`hc.decisive_tokens`)."""
  rng = np.random.default_rng()
  return hc.decisive_tokens(reference, lambda: _tokens(rng, **shape))[0]


def _load_json(path) -> dict:
  return json.loads(pathlib.Path(path).read_text())


def _write(directory, arch, **kwargs) -> pathlib.Path:
  return pathlib.Path(hc.write_checkpoint(directory, arch, **kwargs))


def _copy(src, tmp_path, name="copy"):
  return shutil.copytree(src, tmp_path / name)


# -- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_logits_match_transformers(checkpoints, case):
  arch, tied, overrides = case
  path = checkpoints(arch, tied, **overrides)
  reference = hc.load_model(path)
  tokens = _decisive_tokens(reference)
  want = hc.logits(reference, tokens)
  model, params = load_pretrained(path, dtype="float32")
  assert model.config.tie_embeddings == tied and ("lm_head_dv" in params) == (not tied)
  if arch in ("mistral", "gemma3_text", "gemma2", "gpt_oss", "olmo3"):  # windows shorter than rows
    assert model.config.sliding_window == 48 and model.config.max_seq_len == 512
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4
  if tied:
    return
  # The options under test change the logits far beyond the tolerance: dropping them fails.
  cfg = model.config
  if arch == "llama":
    wrong = dataclasses.replace(cfg, rope_scaling="")
  elif arch == "qwen3_moe":
    wrong = dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
  elif arch == "smollm3":
    wrong = dataclasses.replace(cfg, nope_layers=())
  elif arch == "olmo2":
    wrong = dataclasses.replace(cfg, norm_position="pre")
  elif arch == "olmoe":
    wrong = dataclasses.replace(cfg, norm_topk_prob=True)
  elif arch == "mixtral":
    wrong = dataclasses.replace(cfg, norm_topk_prob=False)
  elif arch in ("mistral", "gemma3_text"):
    wrong = dataclasses.replace(cfg, sliding_window=0, sliding_layers=(), local_rope_theta=0.0)
  elif arch == "ernie4_5":  # q and k left in the checkpoint's interleaved order: wrong
    from jaxrl.model.hf_layout import glm_rotary_order

    back = np.argsort(glm_rotary_order(cfg.head_dim, 0, None))
    unordered = jax.tree_util.tree_map_with_path(
      lambda p, x: x[..., back] if p[-1].key in ("wq_dhe", "wk_dke") else x, params
    )
    assert hc.rel_err(hc.jaxrl_logits(model, unordered, tokens), want) > 1e-2
    return
  elif arch == "glm4":  # the partial rotation, and the base
    for change in (dict(rotary_dim=0), dict(rope_theta=cfg.rope_theta / 10)):
      wrong = Model(dataclasses.replace(cfg, **change))
      assert hc.rel_err(hc.jaxrl_logits(wrong, params, tokens), want) > 1e-2, change
    return
  elif arch == "exaone4":  # the window, and the global layer's NoPE, each
    no_window = dict(sliding_window=0, sliding_layers=())
    for change in (no_window, dict(nope_layers=())):
      wrong = Model(dataclasses.replace(cfg, **change))
      assert hc.rel_err(hc.jaxrl_logits(wrong, params, tokens), want) > 1e-2, change
    return
  elif arch == "olmo3":  # the window, and YaRN kept out of the sliding layer, each
    no_window = dict(sliding_window=0, sliding_layers=(), local_rope_theta=0.0)
    for change in (no_window, dict(local_rope_theta=0.0)):
      wrong = Model(dataclasses.replace(cfg, **change))
      assert hc.rel_err(hc.jaxrl_logits(wrong, params, tokens), want) > 1e-2, change
    return
  elif arch in ("gemma2", "granite", "granitemoe"):  # each option on its own
    gemma2 = (
      dict(attention_logit_softcap=0.0),
      dict(final_logit_softcap=0.0),
      dict(sliding_window=0, sliding_layers=()),
    )
    granite = (
      dict(embedding_multiplier=1.0),
      dict(residual_multiplier=1.0),
      dict(attention_logit_scale=0.0),
      dict(logits_scaling=1.0),
    )
    for change in gemma2 if arch == "gemma2" else granite:
      wrong = Model(dataclasses.replace(cfg, **change))
      assert hc.rel_err(hc.jaxrl_logits(wrong, params, tokens), want) > 1e-2, change
    return
  elif arch == "qwen2_moe":  # without renormalisation; the shared expert's gate counts
    wrong = Model(dataclasses.replace(cfg, norm_topk_prob=True))
    assert hc.rel_err(hc.jaxrl_logits(wrong, params, tokens), want) > 1e-2
    ungated = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.full_like(x, 0.0) if p[-1].key == "shared_gate_d" else x, params
    )
    assert hc.rel_err(hc.jaxrl_logits(model, ungated, tokens), want) > 1e-2
    return
  elif arch == "gpt_oss":  # the clamp, the windows, the sinks and the router's bias, each
    for change in (dict(swiglu_limit=7.0), dict(sliding_window=0, sliding_layers=())):
      wrong = Model(dataclasses.replace(cfg, **change))
      assert hc.rel_err(hc.jaxrl_logits(wrong, params, tokens), want) > 1e-2, change
    for leaf, value in (("sinks_h", -1e9), ("router_b_x", 0.0)):
      changed = jax.tree_util.tree_map_with_path(
        lambda p, x, leaf=leaf, value=value: jnp.full_like(x, value) if p[-1].key == leaf else x,
        params,
      )
      assert hc.rel_err(hc.jaxrl_logits(model, changed, tokens), want) > 1e-2, leaf
    return
  else:
    wrong = dataclasses.replace(cfg, rope_theta=cfg.rope_theta / 10)
  assert hc.rel_err(hc.jaxrl_logits(Model(wrong), params, tokens), want) > 1e-2


def test_expert_parallel_raw_topk_matches_transformers(checkpoints):
  """The expert-parallel layer routes itself: without renormalisation too."""
  path = checkpoints("qwen3_moe", norm_topk_prob=False, num_hidden_layers=1)
  reference = hc.load_model(path)
  tokens = _decisive_tokens(reference)
  want = hc.logits(reference, tokens)
  model, params = load_pretrained(path, dtype="float32")
  mesh = make_mesh(jax.devices()[:2], {"expert": 2})
  moe = MoEInputs(expert_parallel=ExpertParallel(mesh))
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens, moe=moe), want) < 1e-4


# -- greedy generation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "arch",
  [
    "qwen3",
    "llama",
    "smollm3",
    "olmo2",
    "gemma3_text",
    "mistral",
    "gemma2",
    "gpt_oss",
    "olmo3",
    "exaone4",
    "glm4",
  ],  # fmt: skip
)
def test_paged_greedy_matches_transformers_generate(checkpoints, arch):
  """Gemma, Mistral and gpt-oss: prompts and continuations well past their 48-position
  window (gpt-oss: with sinks in paged decode attention, rings of pages for its window)."""
  path = checkpoints(arch)
  rng = np.random.default_rng()
  windowed = ("gemma3_text", "mistral", "gemma2", "gpt_oss", "olmo3", "exaone4")
  lengths = (5, 60) if arch in windowed else (5, 19)
  prompts = [rng.integers(3, hc.VOCAB_SIZE, n).tolist() for n in lengths]
  want = [hc.greedy(hc.load_model(path), p, 32) for p in prompts]
  assert hc.paged_greedy(path, prompts, 32) == want


# -- saving --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [(a, False) for a in hc.ARCHS] + [("qwen3", True)])
def test_save_pretrained_loads_in_transformers(checkpoints, tmp_path, arch, tied):
  path = checkpoints(arch, tied)
  tokens = _tokens(np.random.default_rng(), length=64)
  want = hc.logits(hc.load_model(path), tokens)
  model, params = load_pretrained(path, dtype="float32")
  save_pretrained(model, params, tmp_path / "out")
  assert sorted(os.listdir(tmp_path / "out")) == [
    "config.json",
    "generation_config.json",
    "model.safetensors",
  ]
  reloaded = hc.load_model(tmp_path / "out")
  # Without its source checkpoint, a Phi-3 model is written as Llama: the same network, q/k/v
  # and gate/up unfused; Seed-OSS as Qwen2 and ERNIE 4.5 as Llama, the same networks.
  source_arch = _load_json(path / "config.json")["architectures"][0]
  llama_like = {"phi3": "LlamaForCausalLM", "ernie4_5": "LlamaForCausalLM"}
  written = (llama_like | {"seed_oss": "Qwen2ForCausalLM"}).get(arch, source_arch)
  assert type(reloaded).__name__ == written
  got = hc.logits(reloaded, tokens)
  if written == source_arch:  # the same torch network on the same weights
    assert hc.rel_err(got, want) < 1e-6
  else:  # another network's order of operations (ERNIE's interleaved rotation as Llama's):
    # float32 rounding apart (1.005e-6 seen, with random tokens)
    tolerance.assert_close(got, want, n=tolerance.model_terms(model.config))
  # The generated config.json describes the same model to us too.
  assert config_from_hf(_load_json(tmp_path / "out" / "config.json")) == model.config


@pytest.mark.parametrize("arch", ["mistral", "phi3", "seed_oss", "ernie4_5"])
def test_saved_with_its_source_a_model_keeps_its_architecture(checkpoints, tmp_path, arch):
  """Mistral keeps its window; Phi-3's q/k/v and gate/up are fused again, in Phi-3's order,
  sharded too (a fused tensor is one tensor of one shard); Seed-OSS stays Seed-OSS."""
  path = checkpoints(arch)
  tokens = _tokens(np.random.default_rng(), length=64)
  want = hc.logits(hc.load_model(path), tokens)
  model, params = load_pretrained(path, dtype="float32")
  save_pretrained(model, params, tmp_path / "sourced", source=path, max_shard_size="40KB")
  reloaded = hc.load_model(tmp_path / "sourced")
  assert type(reloaded).__name__ == _load_json(path / "config.json")["architectures"][0]
  assert hc.rel_err(hc.logits(reloaded, tokens), want) < 1e-6
  if arch == "mistral":
    assert _load_json(tmp_path / "sourced" / "config.json")["sliding_window"] == 48
  elif arch == "phi3":
    index = _load_json(tmp_path / "sourced" / "model.safetensors.index.json")["weight_map"]
    assert "model.layers.1.self_attn.qkv_proj.weight" in index
    assert "model.layers.1.mlp.gate_up_proj.weight" in index
    unfused = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not [name for name in index if name.split(".")[-2] in unfused]


def test_save_pretrained_copies_source_files(tmp_path):
  src = _write(tmp_path / "src", "qwen3", tokenizer="qwen3")
  model, params = load_pretrained(src, dtype="float32")
  save_pretrained(model, params, tmp_path / "out", source=src, dtype="bfloat16")
  out = tmp_path / "out"
  for name in os.listdir(src):
    if name not in ("config.json", "model.safetensors"):
      assert (out / name).read_bytes() == (src / name).read_bytes(), name
  src_config, out_config = (_load_json(d / "config.json") for d in (src, out))
  assert out_config.pop("dtype") == "bfloat16"
  src_config.pop("dtype")
  assert out_config == src_config
  reloaded = hc.load_model(out, dtype="auto")
  assert reloaded.dtype == torch.bfloat16
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert (
    tok("How many clips?")["input_ids"]
    == transformers.AutoTokenizer.from_pretrained(src)("How many clips?")["input_ids"]
  )


def test_save_pretrained_refuses_another_models_source(checkpoints, tmp_path):
  model, params = load_pretrained(checkpoints("qwen3"), dtype="float32")
  with pytest.raises(ValueError, match=r"llama.*config\.json describes another model"):
    save_pretrained(model, params, tmp_path / "out", source=checkpoints("llama"))


# -- shards --------------------------------------------------------------------------------------


def test_reads_transformers_shards(tmp_path):
  path = _write(tmp_path / "sharded", "qwen3_moe", max_shard_size="40KB")
  files = os.listdir(path)
  assert "model.safetensors.index.json" in files and "model.safetensors" not in files
  reference = hc.load_model(path)
  tokens = _decisive_tokens(reference)
  want = hc.logits(reference, tokens)
  model, params = load_pretrained(path, dtype="float32")
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 1e-4


def test_writes_shards_with_an_index(checkpoints, tmp_path):
  path = checkpoints("llama")
  model, params = load_pretrained(path, dtype="float32")
  out = tmp_path / "out"
  save_pretrained(model, params, out, max_shard_size=40_000)
  index = _load_json(out / "model.safetensors.index.json")
  shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
  assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
  total = 0
  for shard in shards:
    tensors = load_file(out / shard)
    nbytes = sum(v.nbytes for v in tensors.values())
    assert nbytes <= 40_000 or len(tensors) == 1, shard  # a larger tensor gets its own shard
    total += nbytes
  assert index["metadata"]["total_size"] == total
  tokens = _tokens(np.random.default_rng(), length=64)
  want = hc.logits(hc.load_model(path), tokens)
  assert hc.rel_err(hc.logits(hc.load_model(out), tokens), want) < 1e-6
  _, again = load_pretrained(out, dtype="float32")
  jax.tree.map(np.testing.assert_array_equal, again, params)
  # Saving again as one file removes the shards and the index of the first save.
  save_pretrained(model, params, out)
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


# -- meshes --------------------------------------------------------------------------------------


# OLMo 2: its q/k norms reduce across heads, which the tensor axis splits; gpt-oss: its sinks
# (per head) and expert biases are split with the heads and the experts' width.
@pytest.mark.parametrize("arch", ["qwen2", "olmo2", "gpt_oss"])
def test_loads_onto_a_mesh_in_its_sharding(checkpoints, arch):
  path = checkpoints(arch)
  mesh = make_mesh(jax.devices()[:8], {"fsdp": 4, "tensor": 2})
  model, params = load_pretrained(path, dtype="float32", mesh=mesh)
  rules = STAGE_RULES["train"]
  want = tree_shardings(model.logical_axes, mesh, rules, model.abstract_params())
  for (where, got), expected in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), strict=True
  ):
    assert got.sharding == expected, jax.tree_util.keystr(where)
  # Sharded, not replicated: each device holds an eighth of the embedding.
  shard = params["embed_vd"].addressable_shards[0].data
  assert shard.shape == (hc.VOCAB_SIZE // 2, 64 // 4)
  reference = hc.load_model(path)
  tokens = _decisive_tokens(reference)
  want_logits = hc.logits(reference, tokens)
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want_logits) < 1e-4


_PEAK_SCRIPT = textwrap.dedent(
  """
  import json, os, resource, sys
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np
  from jaxrl.model import load_pretrained
  from jaxrl.sharding import make_mesh

  mesh = make_mesh(jax.devices(), {"fsdp": 4, "tensor": 2})
  jax.device_put(np.ones(8)).block_until_ready()  # the backend is up before measuring

  def status(key):
    for line in open("/proc/self/status"):
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024

  try:  # reset the high-water mark to the current resident size
    open("/proc/self/clear_refs", "w").write("5")
    base, peak_of = status("VmRSS"), lambda: status("VmHWM")
  except OSError:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_of = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  model, params = load_pretrained(sys.argv[1], dtype="bfloat16", mesh=mesh)
  jax.block_until_ready(params)
  print(json.dumps({"base": base, "peak": peak_of()}))
  """
)


def test_loading_holds_one_tensor_beyond_the_params(tmp_path):
  """A bf16 checkpoint loads onto a mesh with peak memory growth below 1.5x its size."""
  cfg = ModelConfig(
    vocab_size=16384,
    d_model=1024,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=128,
    mlp_dim=4096,
    tie_embeddings=False,
    dtype="bfloat16",
    param_dtype="bfloat16",
  )
  model, rng = Model(cfg), np.random.default_rng()
  params = jax.tree.map(
    lambda x: rng.standard_normal(x.shape, np.float32).astype(x.dtype), model.abstract_params()
  )
  save_pretrained(model, params, tmp_path / "big")
  del params
  size = os.path.getsize(tmp_path / "big" / "model.safetensors")
  assert size > 100e6
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "big")],
    capture_output=True,
    text=True,
    env=env,
    check=True,
  )
  memory = json.loads(run.stdout.strip().splitlines()[-1])
  assert memory["peak"] - memory["base"] < 1.5 * size, (memory, size)


# -- bf16 ----------------------------------------------------------------------------------------


def test_bfloat16_load(checkpoints):
  path = checkpoints("qwen3")
  model, params = load_pretrained(path, dtype="bfloat16")
  assert (model.config.dtype, model.config.param_dtype) == ("bfloat16", "bfloat16")
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  disk = load_file(path / "model.safetensors")
  embed = disk["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(params["embed_vd"]), embed)
  tokens = _tokens(np.random.default_rng(), length=64)
  want = hc.logits(hc.load_model(path), tokens)
  assert hc.rel_err(hc.jaxrl_logits(model, params, tokens), want) < 0.05


def test_reads_a_bfloat16_checkpoint_without_torch(tmp_path):
  path = _write(tmp_path / "bf16", "qwen3_moe", dtype="bfloat16")
  reference = hc.load_model(path, dtype=torch.bfloat16).state_dict()
  _, params = load_pretrained(path, dtype="float32")
  want = reference["model.layers.1.self_attn.q_proj.weight"].float().numpy()
  got = np.asarray(params["blocks"][1]["attn"]["wq_dhe"])  # [d, h, e]
  np.testing.assert_array_equal(got.reshape(got.shape[0], -1).T, want)
  # transformers keeps the experts fused in memory [x, 2f, d]; on disk they are per expert.
  want_up = reference["model.layers.0.mlp.experts.gate_up_proj"].float().numpy()[:, 32:]
  got_up = np.asarray(params["blocks"][0]["mlp"]["w_up_xdf"])  # [x, d, f]
  np.testing.assert_array_equal(got_up.transpose(0, 2, 1), want_up)


def test_reads_fused_experts(checkpoints, tmp_path):
  """A checkpoint holding transformers 5's fused expert tensors loads to the same params."""
  path = checkpoints("qwen3_moe")
  _, params = load_pretrained(path, dtype="float32")
  tensors = load_file(path / "model.safetensors")
  for i in range(2):
    p = f"model.layers.{i}.mlp.experts."
    gate = [tensors.pop(f"{p}{j}.gate_proj.weight") for j in range(8)]
    up = [tensors.pop(f"{p}{j}.up_proj.weight") for j in range(8)]
    down = [tensors.pop(f"{p}{j}.down_proj.weight") for j in range(8)]
    tensors[p + "gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
    tensors[p + "down_proj"] = np.stack(down)
  fused = _copy(path, tmp_path)
  save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
  _, again = load_pretrained(fused, dtype="float32")
  jax.tree.map(np.testing.assert_array_equal, again, params)
