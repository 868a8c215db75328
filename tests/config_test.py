"""Config files build and convert; bad keys and values are reported by their full path."""

import glob
import importlib.util
import os

import ml_collections
import pytest

from jaxrl.config import (
  ConfigError,
  ExperimentConfig,
  default_config,
  from_config_dict,
  load_config,
  model_config,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))


def load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def variants(module):
  return getattr(module, "VARIANTS", (None,))


def test_there_are_config_files():
  assert CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_file_builds(path):
  module = load(path)
  for arg in variants(module):
    cfg = from_config_dict(module.get_config(arg))
    assert isinstance(cfg, ExperimentConfig)


def test_grpo_tiny_variants_are_listed():
  module = load(os.path.join(REPO, "configs", "grpo_tiny.py"))
  assert {"colocated", "test"} <= set(variants(module))


def test_unknown_key_names_its_path():
  cd = default_config()
  cd.train.optimizer.lerning_rate = 1e-3
  with pytest.raises(ConfigError, match=r"config\.train\.optimizer\.lerning_rate: unknown key"):
    from_config_dict(cd)


def test_wrong_type_names_its_path():
  cd = default_config().to_dict()
  cd["rollout"]["group_size"] = "eight"
  with pytest.raises(ConfigError, match=r"config\.rollout\.group_size: expected int"):
    from_config_dict(cd)
  cd = default_config().to_dict()
  cd["resume"] = 1
  with pytest.raises(ConfigError, match=r"config\.resume: expected bool"):
    from_config_dict(cd)


def test_invalid_value_names_its_section():
  cd = default_config()
  cd.train.loss.aggregation = "sum"
  with pytest.raises(ConfigError, match=r"config\.train\.loss"):
    from_config_dict(cd)


# (key, bad value, what the message must say): every value a config can set out of range fails
# at conversion, with the key's full path, not later inside the library under another name.
BAD_VALUES = [
  ("rollout.prompts_per_step", 0, "config.rollout.prompts_per_step must be >= 1, got 0."),
  ("rollout.group_size", 0, "config.rollout.group_size must be >= 2"),
  ("rollout.group_size", 1, "config.rollout.group_size must be >= 2"),
  ("rollout.dynamic_sampling_rounds", 0, "config.rollout.dynamic_sampling_rounds must be >= 1"),
  ("rollout.param_dtype", "float16", "config.rollout.param_dtype='float16': use one of"),
  ("rollout.num_processes", 0, "config.rollout.num_processes must be >= 1, got 0."),
  ("rollout.num_processes", 2, "config.rollout.num_processes=2: a rollout worker of several"),
  ("train.steps", -1, "config.train.steps must be >= 0, got -1."),
  ("train.updates_per_step", 0, "config.train.updates_per_step must be >= 1, got 0."),
  ("train.micro_batch_size", 0, "config.train.micro_batch_size must be >= 1, got 0."),
  ("train.micro_batch_size", 5, "config.train.micro_batch_size=5: a step's 128 sequences"),
  ("train.updates_per_step", 3, "config.train.updates_per_step=3 updates"),
  ("train.logprob_chunk", 0, "config.train.logprob_chunk must be >= 1, got 0."),
  ("train.pack_length", -2, "config.train.pack_length must be -1 (rows as long as the run's"),
  ("train.advantage", "ppo", "config.train.advantage='ppo': use one of ('grpo', 'drgrpo')."),
  ("train.num_processes", 0, "config.train.num_processes must be >= 1, got 0."),
  ("train.num_processes", 2, "config.train.num_processes=2: a learner of several processes"),
  ("warmup.steps", -1, "config.warmup.steps must be >= 0, got -1."),
  ("warmup.batch_size", 0, "config.warmup.batch_size must be >= 1, got 0."),
  ("warmup.learning_rate", -1e-3, "config.warmup.learning_rate must be >= 0, got -0.001."),
  ("eval.every", -1, "config.eval.every must be >= 0, got -1."),
  ("eval.num_prompts", 0, "config.eval.num_prompts must be >= 1, got 0."),
  ("eval.temperature", -0.5, "config.eval.temperature must be >= 0, got -0.5."),
  ("checkpoint.every", -1, "config.checkpoint.every must be >= 0, got -1."),
  ("checkpoint.max_to_keep", 0, "config.checkpoint.max_to_keep must be >= 1, got 0."),
  ("checkpoint.hf_every", -1, "config.checkpoint.hf_every must be >= 0, got -1."),
  ("checkpoint.hf_dtype", "fp16", "config.checkpoint.hf_dtype='fp16': use one of"),
  ("placement.mode", "split", "config.placement.mode='split': use one of"),
  ("placement.rollout_devices", 0, "config.placement.rollout_devices must be >= 1, got 0."),
  ("placement.train_devices", -1, "config.placement.train_devices must be >= 1, got -1."),
  ("placement.train_mesh.tensor", 0, "config.placement.train_mesh.tensor must be >= 1, or -1"),
  ("placement.rollout_mesh.expert", -2, "config.placement.rollout_mesh.expert must be >= 1"),
  ("placement.rollout_mesh.tensor", -1, "config.placement.rollout_mesh: data and tensor are"),
  ("rollout.sampling.top_k", 20, "config.rollout.sampling.top_k=20, top_p=1.0: responses"),
  ("rollout.sampling.top_p", 0.9, "config.rollout.sampling.top_k=0, top_p=0.9: responses"),
  ("loop.max_staleness", -1, "config.loop.max_staleness must be >= 0, got -1."),
  ("loop.rollout_workers", -1, "config.loop.rollout_workers must be >= 0"),
  # NaN passes every `value < minimum` check: non-finite floats are refused where read.
  ("train.optimizer.learning_rate", float("nan"), "optimizer.learning_rate: expected a finite"),
  ("train.optimizer.max_grad_norm", float("nan"), "optimizer.max_grad_norm: expected a finite"),
  ("eval.temperature", float("inf"), "config.eval.temperature: expected a finite number, got inf"),
  ("train.loss.kl_weight", float("nan"), "config.train.loss.kl_weight: expected a finite"),
  ("seed", -1, "config.seed must be >= 0, got -1."),
]


@pytest.mark.parametrize("key, value, message", BAD_VALUES, ids=lambda x: str(x)[:40])
def test_bad_value_names_its_key(key, value, message):
  cd = default_config()
  *parents, leaf = key.split(".")
  node = cd
  for parent in parents:
    node = node[parent]
  node[leaf] = value
  with pytest.raises(ConfigError) as error:
    from_config_dict(cd)
  assert message in str(error.value)


def test_a_decaying_schedule_must_last_the_run():
  cd = default_config()
  cd.train.optimizer.schedule = "cosine"
  cd.train.steps, cd.train.updates_per_step = 600, 2
  with pytest.raises(ConfigError, match=r"total_steps=1000: the 'cosine' schedule .* 1200 upd"):
    from_config_dict(cd)
  cd.train.optimizer.total_steps = 1200
  from_config_dict(cd)


def test_load_config_overrides_of_unknown_or_scalar_keys_name_the_key():
  path = os.path.join(REPO, "configs", "grpo_tiny.py")
  with pytest.raises(ConfigError, match=r"config.rolout.group_size=4: cannot override"):
    load_config(path, "test", {"rolout.group_size": 4})
  with pytest.raises(ConfigError, match=r"config.train.steps.x=1: cannot override"):
    load_config(path, "test", {"train.steps.x": 1})
  with pytest.raises(ConfigError, match=r"config.train.steps='5': cannot override"):
    load_config(path, "test", {"train.steps": "5"})


def test_boundary_values_are_accepted():
  cd = default_config()
  cd.rollout.group_size = 2
  cd.rollout.prompts_per_step = 32  # 64 sequences: one micro-batch of the default 64
  cd.train.steps = 0
  cd.warmup.learning_rate = 0.0
  cd.eval.every = 0
  cd.eval.temperature = 0.0
  cd.checkpoint.every = 0
  cd.checkpoint.max_to_keep = 1
  cd.placement.train_mesh.fsdp = 1
  cd.placement.train_mesh.tensor = -1
  from_config_dict(cd)


def test_truncated_sampling_trains_only_with_a_behaviour_correction():
  cd = default_config()
  cd.rollout.sampling.top_p = 0.9
  cd.train.loss.proximal = "recompute"
  cd.train.loss.behaviour_correction = "truncate"
  assert from_config_dict(cd).rollout.sampling.top_p == 0.9


def test_locked_config_rejects_unknown_override():
  cd = default_config()
  cd.lock()
  with pytest.raises(AttributeError):
    cd.train.stepz = 3


def test_defaults_round_trip():
  cfg = from_config_dict(default_config())
  assert cfg == ExperimentConfig()
  assert isinstance(default_config(), ml_collections.ConfigDict)


def test_auto_attention_on_hopper_is_the_pallas_kernel_where_cudnn_cannot_serve(monkeypatch):
  """cuDNN's fused attention computes in bf16 only, and needs jax's (private) cuDNN module:
  a float32 model, or a jax without the module, gets our flash kernel instead."""
  from jaxrl.kernels.flash_attention import cudnn

  config = default_config()
  config.model = model_config("qwen3-0.6b")
  config.model.attention = "auto"
  config.model.dtype = "float32"
  assert from_config_dict(config, "gpu", "9.0").model.attention == "flash"
  config.model.dtype = "bfloat16"
  assert from_config_dict(config, "gpu", "9.0").model.attention == "cudnn"
  monkeypatch.setattr(cudnn, "_cudnn", None)
  assert from_config_dict(config, "gpu", "9.0").model.attention == "flash"


def test_auto_attention_on_hopper_is_the_pallas_kernel_for_narrow_models():
  """The main job's 128-wide model ran faster with the Pallas kernel than with cuDNN (H100,
  docs/BENCHMARKS.md); Qwen3-0.6B's width (1,024) and checkpoints, whose shapes are read
  later, take cuDNN."""
  config = default_config()
  config.model = model_config("tiny")
  config.model.dtype = "bfloat16"
  config.model.attention = "auto"
  assert from_config_dict(config, "gpu", "9.0").model.attention == "flash"
  config.model.d_model = 1024
  assert from_config_dict(config, "gpu", "9.0").model.attention == "cudnn"
  config.model.d_model = 896
  assert from_config_dict(config, "gpu", "9.0").model.attention == "flash"
  config.pretrained.path = "Qwen/Qwen2.5-0.5B-Instruct"
  assert from_config_dict(config, "gpu", "9.0").model.attention == "cudnn"


@pytest.mark.parametrize(
  ("backend", "compute", "rollout"),
  [("cpu", "float32", ""), ("gpu", "bfloat16", "bfloat16"), ("tpu", "bfloat16", "bfloat16")],
)
def test_auto_settings_follow_the_backend(backend, compute, rollout):
  config = default_config()
  config.model.d_model = 1024  # wide enough for cuDNN (narrow models: the test above)
  config.model.dtype = "auto"
  config.rollout.param_dtype = "auto"
  config.model.attention = "auto"
  config.model.moe_dispatch = "auto"
  cfg = from_config_dict(config, backend=backend)
  assert (cfg.model.dtype, cfg.rollout.param_dtype) == (compute, rollout)
  # Flash attention (cuDNN's, in bf16) and the grouped MoE dispatch on Hopper-class GPUs only,
  # where they were measured.
  assert (cfg.model.attention, cfg.model.moe_dispatch) == ("dense", "dense")
  for capability, attention in [("9.0", "cudnn"), ("10.0", "cudnn"), ("8.9", "dense")]:
    cfg = from_config_dict(config, backend=backend, compute_capability=capability)
    assert cfg.model.attention == (attention if backend == "gpu" else "dense")
    hopper = backend == "gpu" and capability != "8.9"
    assert cfg.model.moe_dispatch == ("grouped" if hopper else "dense")
  assert cfg.model.param_dtype == "float32"  # master weights stay fp32
  # The shipped demo says "auto", in every variant.
  module = load(os.path.join(REPO, "configs", "grpo_tiny.py"))
  for arg in variants(module):
    shipped = from_config_dict(module.get_config(arg), backend=backend)
    assert (shipped.model.dtype, shipped.rollout.param_dtype) == (compute, rollout)
    hopper = from_config_dict(module.get_config(arg), backend=backend, compute_capability="9.0")
    assert hopper.model.attention == ("flash" if backend == "gpu" else "dense")  # narrow model
  with pytest.raises(ConfigError, match="config.model.*dtype"):
    config.model.dtype = "fp8"
    from_config_dict(config, backend=backend)
