"""What `"auto"` means in an experiment config (`model.dtype`, `rollout.param_dtype`,
`model.attention`, `model.moe_dispatch`) on the backend at hand: `auto_settings`, and
`resolve_auto`, which `jaxrl.config.from_config_dict` applies before it builds the
dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model.config import ModelConfig

_AUTO_KEYS = (
  ("model", "dtype"),
  ("rollout", "param_dtype"),
  ("model", "attention"),
  ("model", "moe_dispatch"),
)


def resolve_auto(
  config: dict[str, Any], backend: str | None = None, compute_capability: str | None = None
) -> dict[str, Any]:
  """`config` (a plain dict of sections) with each "auto" setting replaced by what it means
  here (`auto_settings`); cuDNN's attention only where the model can take it: bf16, and
  wide enough or a checkpoint (`_takes_cudnn`)."""
  auto = auto_settings(backend, compute_capability)
  for section, key in _AUTO_KEYS:
    values = config.get(section)
    if isinstance(values, Mapping) and values.get(key) == "auto":
      setting = auto[f"{section}.{key}"]
      if setting == "cudnn" and not _takes_cudnn(values, config.get("pretrained")):
        setting = "flash"
      config[section] = {**values, key: setting}
  return config


# cuDNN's packed attention ran Qwen3-0.6B's learner update 1.17x as fast as the Pallas kernel
# at 4k tokens (d_model 1,024, 28 layers; H100, docs/BENCHMARKS.md). On narrower models it has
# not been timed, and it has fixed costs the Pallas kernel lacks (its layout check waits for the
# host once a layer, `kernels/flash_attention/cudnn.py`), while the Pallas kernel ran the main
# job's 2-layer, 128-wide model 1.10x as fast as dense attention (its 600 steps in 108 s against
# 119 s, same H100). So "auto" takes cuDNN from the width measured, and for checkpoints (their
# shapes are read later; Qwen2.5-0.5B's 896 is the one supported model narrower than that).
_CUDNN_MIN_D_MODEL = 1024


def _takes_cudnn(model: Mapping[str, Any], pretrained: Any) -> bool:
  """Whether "auto" attention should be cuDNN's for this model section (see above)."""
  if model.get("dtype", ModelConfig.dtype) != "bfloat16":
    return False  # cuDNN's fused attention computes in bf16 only
  if isinstance(pretrained, Mapping) and pretrained.get("path"):
    return True  # the shapes come from the checkpoint, read later
  return model.get("d_model", ModelConfig.d_model) >= _CUDNN_MIN_D_MODEL


def auto_settings(
  backend: str | None = None, compute_capability: str | None = None
) -> dict[str, str]:
  """What `"auto"` means on `backend` ("cpu", "gpu", "tpu") and, for a GPU, its
  `compute_capability` ("9.0"); both default to those of JAX's default device.

  Dtypes: on accelerators bf16 compute (and KV cache) and bf16 rollout weights (the learner's
  fp32 master weights cast once per sync, not at every use); on CPU, which has no fast bf16
  matmuls, fp32 compute and rollout weights in `model.param_dtype`. Attention: "cudnn" on
  Hopper-class GPUs (compute capability 9.x, 10.x), "flash" there where this jax lacks the
  cuDNN module (and `resolve_auto` takes "flash" for a model that computes in float32, which
  cuDNN does not, or is narrower than `_CUDNN_MIN_D_MODEL` and not a checkpoint): flash
  attention was faster than dense at every length measured (1k-16k tokens, H200; a 16k-token
  learner step took 9 GiB against 46), and cuDNN's kernel for packed rows ran a 4k-token
  learner step 1.17x as fast as our Triton kernel (H100; docs/BENCHMARKS.md); "dense"
  elsewhere: CPU (the flash reference is slower at short lengths), TPU (its kernel has not run
  on a TPU yet) and other GPUs (the kernel has not run on them; some have under half a
  Hopper's shared memory per block). On a TPU v5e, whose chip has 15.75 GiB, XLA's plan of a
  16k-token Qwen3-0.6B update needs 21.2 GiB of temporaries with dense attention and 7.1 GiB
  in all with flash (compiled without a TPU, `launch/bench.py kernels`): set
  `model.attention=flash` there for long responses.

  MoE dispatch without an expert axis: "grouped" (`jaxrl.kernels.gmm` on each expert's rows) on
  Hopper-class GPUs, "dense" (every expert on every token) elsewhere. The Pallas `gmm` ran
  Qwen3-30B-A3B's expert shapes at 122-384 TFLOP/s on an H200 (8-128 experts, 8k-16k rows;
  docs/BENCHMARKS.md), where "dense" does `num_experts / experts_per_token` times the work (4x
  for Mixtral's 8 experts, 16x for Qwen3-30B-A3B's 128): to keep up it would need that rate
  times the ratio, 950-1,540 TFLOP/s at 8 experts and 1,950-3,730 at 128, against the card's
  989 bf16 peak (`launch/bench.py moe_layer` times the two on a GPU). On CPU, where `gmm` is
  XLA's `ragged_dot`, the grouped layer was slower (`moe_layer`); on TPU and older GPUs
  `gmm`'s kernel has not run yet."""
  if backend is None:
    import jax  # here: reading a config must not start a backend unless "auto" asks

    backend = jax.default_backend()
    device = jax.devices()[0]
    if device.platform == "gpu":
      compute_capability = getattr(device, "compute_capability", None)
  on_cpu = backend == "cpu"
  major = int(compute_capability.split(".")[0]) if compute_capability else 0
  hopper = backend in ("gpu", "cuda") and major in (9, 10)
  attention = "dense"
  if hopper:
    from jaxrl.kernels.flash_attention import cudnn

    attention = "cudnn" if cudnn.available() else "flash"
  return {
    "model.dtype": "float32" if on_cpu else "bfloat16",
    "rollout.param_dtype": "" if on_cpu else "bfloat16",
    "model.attention": attention,
    "model.moe_dispatch": "grouped" if hopper else "dense",
  }
