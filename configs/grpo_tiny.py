"""GRPO on digit sorting with the tiny model, on the 8 local (CPU) devices.

Run:
  python launch/train.py --config configs/grpo_tiny.py --workdir /tmp/grpo_tiny

Variants (`--config configs/grpo_tiny.py:ARG`):
  (none)      the demo: a short supervised warm-up, then 600 GRPO steps; about 2.5 minutes on a
              2-core CPU. Held-out exact-match reward goes from about 0.55 to about 0.85.
              Disaggregated, with the rollout/training split and both mesh shapes chosen by
              the scheduler's planner for these devices (on 8 CPU devices: 4 + 4).
  colocated   the same with rollout and training sharing one mesh.
  fixed       the same with the split fixed by hand (placement.rollout_devices and
              placement.train_devices, 4 + 4).
  moe         the MoE model (tiny-moe: 8 experts, top-2), expert-parallel on both stages
              (rollout mesh data 2 x expert 2, training mesh fsdp 2 x expert 2), with routing
              replay and a least-loaded expert placement planned per micro-batch.
  test        3 RL steps, tiny batches: the smoke test the test suite runs.
"""

from jaxrl.config import default_config, model_config

VARIANTS = (None, "colocated", "fixed", "moe", "test")


def get_config(arg: str | None = None):
  config = default_config()
  config.seed = 0
  config.model = model_config("tiny")
  # bf16 compute, KV cache and rollout weights on a GPU or TPU (fp32 master weights and
  # optimizer state); fp32 on CPU.
  config.model.dtype = "auto"
  config.rollout.param_dtype = "auto"
  # Dense attention on CPU; on a Hopper GPU the Pallas flash kernel, which ran this job 1.10x as
  # fast as dense there (`jaxrl.auto_config`; docs/BENCHMARKS.md).
  config.model.attention = "auto"
  # Sort 6 digits: "sort:529130=" -> "012359". Exact match scores 1, anything else 0.
  config.task.name = "digit_sort"
  config.task.sort_length = 6

  config.placement.mode = "planned"
  config.placement.rollout_devices = 4  # used by the `fixed` variant
  config.placement.train_devices = 4

  config.rollout.prompts_per_step = 16
  config.rollout.group_size = 8
  config.rollout.sampling.temperature = 1.0
  config.rollout.sampling.max_new_tokens = 8
  # Every response of a step decodes in one running batch; prompt + response fit one page.
  config.rollout.paged.page_size = 16
  config.rollout.paged.num_pages = 256
  config.rollout.paged.max_running = 128

  # Just enough supervised steps that some sampled responses are right: GRPO needs groups
  # whose rewards differ. RL gains are measured from the checkpoint saved after this.
  config.warmup.steps = 60
  config.warmup.batch_size = 64
  config.warmup.learning_rate = 3e-3

  config.train.steps = 600
  config.train.advantage = "grpo"
  config.train.updates_per_step = 2
  config.train.micro_batch_size = 32
  config.train.loss.clip_low = 0.2
  config.train.loss.clip_high = 0.28
  config.train.loss.aggregation = "token-mean"
  config.train.optimizer.learning_rate = 1e-4
  config.train.optimizer.warmup_steps = 10  # Adam's first steps are sign-like: ease in.
  config.train.optimizer.total_steps = 1200  # optimizer updates: steps * updates_per_step

  config.eval.every = 50
  config.eval.num_prompts = 256
  config.eval.temperature = 0.0
  config.checkpoint.every = 100

  if arg == "colocated":
    config.placement.mode = "colocated"
  elif arg == "fixed":
    config.placement.mode = "disaggregated"
  elif arg == "moe":
    config.model = model_config("tiny-moe")
    config.model.dtype = "auto"
    config.model.attention = "auto"
    config.placement.mode = "disaggregated"
    config.placement.rollout_mesh.data = 2
    config.placement.rollout_mesh.expert = 2
    config.placement.train_mesh.fsdp = 2
    config.placement.train_mesh.expert = 2
    config.train.moe.routing_replay = True
    config.train.moe.placement = "least_loaded"
  elif arg == "test":
    config.warmup.steps = 2
    config.rollout.prompts_per_step = 4
    config.rollout.group_size = 4
    config.train.steps = 3
    config.train.micro_batch_size = 8
    config.eval.every = 3
    config.eval.num_prompts = 8
    config.checkpoint.every = 0
  elif arg:
    raise ValueError(f"Unknown variant {arg!r} of grpo_tiny; use colocated, fixed, moe or test.")
  return config
