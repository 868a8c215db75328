"""GRPO on math word problems from a Hugging Face checkpoint, on one GPU or TPU host.

Run (a local checkpoint directory, or a Hub id that is downloaded once):
  python launch/train.py --config configs/grpo_hf.py:qwen3-0.6b --workdir /tmp/grpo_qwen3 \
      --config.pretrained.path=Qwen/Qwen3-0.6B --config.task.path=/data/gsm8k

`task.path` is a JSONL or Parquet file, or a directory of Parquet shards as `datasets` saves
them (GSM8K: fields question / answer with `#### 42`; MATH: problem / solution with \\boxed{}:
set task.question_field and task.answer_field). Without it the run uses the project's sample
of 60 problems (jaxrl/data/samples/math_sample.jsonl), enough to see the loop work.

Variants (`--config configs/grpo_hf.py:ARG`); each sets the checkpoint's Hub id as
`pretrained.path`, override it with a local directory:
  qwen3-0.6b     Qwen/Qwen3-0.6B, thinking off (short answers), one accelerator.
  qwen3-1.7b     Qwen/Qwen3-1.7B, likewise.
  qwen2.5-1.5b   Qwen/Qwen2.5-1.5B-Instruct.
  llama-3.2-1b   meta-llama/Llama-3.2-1B-Instruct (gated on the Hub: log in first).
  qwen3-30b-a3b  Qwen/Qwen3-30B-A3B, MoE: expert-parallel over the host's 8 accelerators,
                 routing replay.
  test           a few tiny steps on CPU (the test suite's; give pretrained.path and task.path).

What runs where: rollout and learner share the host's accelerator(s) (placement colocated,
`placement.train_devices` of them: 1 by default). The learner keeps fp32 master weights and
Adam's second moment, the first moment and the gradient summed over micro-batches in bf16
(`train.optimizer.mu_dtype`, `train.optimizer.grad_accum_dtype`), and computes in bf16 with
rematerialised blocks that keep flash attention's output (`model.remat_policy`, so the backward
pass does not run the attention forward again) and, on Hopper GPUs, flash attention through
cuDNN (`model.attention="auto"`), and an MoE checkpoint's experts as grouped matmuls where
no expert axis spreads them (`model.moe_dispatch="auto"`); rollout generates from bf16 copies
(`rollout.param_dtype`); log-probs are computed a block of vocabulary rows at a time, blocks of
`train.logprob_chunk` positions' worth, so no [tokens, vocab] fp32 logits exist whole;
sequences are packed into rows as long as the longest one (`train.pack_length`), so the learner
compiles its update once. The policy is written in Hub layout to `<workdir>/hf/step_<N>` every
`checkpoint.hf_every` steps and to `<workdir>/hf/final`.
"""

import os

import jaxrl.data
from jaxrl.config import default_config

SAMPLE_DATA = os.path.join(os.path.dirname(jaxrl.data.__file__), "samples", "math_sample.jsonl")

HUB_IDS = {
  "qwen3-0.6b": "Qwen/Qwen3-0.6B",
  "qwen3-1.7b": "Qwen/Qwen3-1.7B",
  "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
  "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
  "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
}
VARIANTS = (*HUB_IDS, "test")


def get_config(arg: str | None = None):
  if arg not in VARIANTS:
    raise ValueError(f"configs/grpo_hf.py needs a variant, one of {list(VARIANTS)}; got {arg!r}.")
  config = default_config()
  config.seed = 0
  config.pretrained.path = HUB_IDS.get(arg, "")
  config.pretrained.enable_thinking = not arg.startswith("qwen3")
  config.tokenizer = "pretrained"

  config.task.name = "math"
  config.task.path = SAMPLE_DATA
  config.task.eval_size = 128

  # bf16 compute on fp32 master weights; rollout from bf16 copies; blocks rematerialised.
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"
  config.model.remat = True
  # Keep flash attention's output and log-sum-exp (a few MiB a layer per 1k tokens): the
  # backward then runs 28 attention forwards instead of 56 (compiled for an H100,
  # docs/BENCHMARKS.md). Dense attention (CPU, other GPUs) keeps nothing more.
  config.model.remat_policy = "save_attention"
  # Flash attention on Hopper (2.3x dense at 16k tokens, 9 GiB vs 46), through cuDNN in bf16.
  config.model.attention = "auto"
  # An MoE checkpoint without an expert axis runs its experts as grouped matmuls on Hopper
  # (every expert on every token elsewhere).
  config.model.moe_dispatch = "auto"
  config.model.max_seq_len = 2048  # capped by the checkpoint's own limit
  config.rollout.param_dtype = "bfloat16"

  config.placement.mode = "colocated"
  config.placement.train_devices = 1
  config.placement.train_mesh.fsdp = -1
  config.placement.rollout_mesh.data = -1

  config.rollout.prompts_per_step = 32
  config.rollout.group_size = 8
  config.rollout.sampling.temperature = 1.0
  config.rollout.sampling.max_new_tokens = 1024
  config.rollout.paged.page_size = 16
  config.rollout.paged.num_pages = 8192  # 131k cached tokens: 14 GiB of bf16 KV for Qwen3-0.6B
  config.rollout.paged.max_running = 128
  config.rollout.paged.prefill_chunk = 512

  config.warmup.steps = 0
  config.train.steps = 200
  config.train.advantage = "grpo"
  config.train.updates_per_step = 2
  config.train.micro_batch_size = 8
  config.train.logprob_chunk = 128
  config.train.loss.clip_low = 0.2
  config.train.loss.clip_high = 0.28  # DAPO clip-higher
  config.train.loss.aggregation = "token-mean"
  config.train.loss.kl_weight = 0.0  # no reference copy is kept
  config.train.optimizer.mu_dtype = "bfloat16"  # 2 bytes per parameter less; nu stays fp32
  # The gradient summed over micro-batches in bf16 (each added in fp32): 2 bytes per parameter
  # less at the learner's peak.
  config.train.optimizer.grad_accum_dtype = "bfloat16"
  config.train.optimizer.learning_rate = 1e-6
  config.train.optimizer.warmup_steps = 10
  config.train.optimizer.total_steps = 400  # optimizer updates: steps * updates_per_step

  config.eval.every = 10
  config.eval.num_prompts = 128
  config.eval.temperature = 0.0
  config.checkpoint.every = 50
  config.checkpoint.hf_every = 50

  if arg == "qwen3-30b-a3b":
    config.placement.train_devices = 8
    config.placement.train_mesh.fsdp = 1
    config.placement.train_mesh.expert = -1
    config.placement.rollout_mesh.data = 1
    config.placement.rollout_mesh.expert = -1
    config.train.moe.routing_replay = True
    config.rollout.prompts_per_step = 16
  elif arg == "test":
    config.model.dtype = "float32"
    config.rollout.param_dtype = ""
    config.model.max_seq_len = 512
    config.rollout.prompts_per_step = 2
    config.rollout.group_size = 2
    config.rollout.sampling.max_new_tokens = 8
    config.rollout.paged.num_pages = 128
    config.rollout.paged.max_running = 8
    config.train.steps = 2
    config.train.updates_per_step = 1
    config.train.micro_batch_size = 2
    config.train.logprob_chunk = 16
    config.eval.every = 2
    config.eval.num_prompts = 2
    config.checkpoint.every = 0
    config.checkpoint.hf_every = 1
  return config
