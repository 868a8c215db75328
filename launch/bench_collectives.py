"""`python launch/bench.py collectives`: what a training mesh's layout costs in communication,
with the residual stream pinned between blocks (`Learner.activation_sharding`, as the learner
runs) and left to XLA (`free`: the learner before 2026-11-27, the baseline of the same run).

- `plan_qwen3-0.6b_<mesh>_<pinned|free>`: the packed micro-step of a Qwen3-0.6B-shaped learner
  (bf16 compute, fp32 master weights, bf16 gradient sums, remat, dense attention, one row of
  `length` positions per device) compiled for 8 CPU devices and not run: per kind of
  collective, how many and the MiB their results take on each device
  (`update_plan.collective_traffic`), and XLA's temporaries. The SPMD partitioner that decides
  what crosses devices runs before any backend's code generation, so 8 GPUs or TPU chips with
  the same mesh get the same collectives; XLA:CPU writes a gradient's reduce-scatter as an
  all-reduce, which a GPU or TPU compile turns into a reduce-scatter.
- `update_<mesh>_<pinned|free>`: the demo's learner update (`configs/grpo_tiny.py`: its tiny
  model, 128 sequences of 21 tokens, packed rows of 24 positions, 2 optimizer updates of 2
  micro-batches) run on 4 CPU devices: median seconds of `repeats` updates after 2 warm ones,
  the two layouts taking turns.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_MESHES = ({"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 8})
UPDATE_MESHES = ({"fsdp": 4}, {"data": 4})


def _name(axes: dict) -> str:
  return "x".join(f"{axis}{size}" for axis, size in axes.items())


def _plan(axes: dict, pinned: bool, length: int) -> dict:
  from jaxrl.model import Model, get_preset
  from jaxrl.sharding import TRAIN_RULES, make_mesh
  from jaxrl.train import Learner, LossConfig, OptimizerConfig, update_plan

  cfg = get_preset(
    "qwen3-0.6b", dtype="bfloat16", param_dtype="float32", remat=True, attention="dense",
    max_seq_len=length + 1,
  )  # fmt: skip
  devices = jax.devices()[:8]
  learner = Learner(
    Model(cfg),
    make_mesh(devices, axes),
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(mu_dtype="bfloat16", grad_accum_dtype="bfloat16"),
    updates_per_step=1,
    micro_batch_size=len(devices),
    temperature=1.0,
    pack_length=length,
    abstract=True,
  )
  if not pinned:
    learner.activation_sharding = None  # the baseline: XLA's own choice
  start = time.perf_counter()
  micro_step = update_plan.compiled_update(learner, len(devices), length + 1)[0]
  traffic = update_plan.collective_traffic([micro_step])
  row = {f"{kind}_{key}": value for kind, entry in traffic.items() for key, value in entry.items()}
  row["collective_mib"] = sum(entry["mib"] for entry in traffic.values())
  row["temporaries_gib"] = micro_step.memory_analysis().temp_size_in_bytes / 2**30
  row["compile_s"] = time.perf_counter() - start
  return row


def _demo_learner(axes: dict, pinned: bool):
  from jaxrl.config import load_config
  from jaxrl.model import Model
  from jaxrl.rl.policy import make_tokenizer, model_config
  from jaxrl.rl.stages import make_learner
  from jaxrl.sharding import make_mesh

  cfg = load_config(os.path.join(_REPO, "configs", "grpo_tiny.py"), None, {"train.pack_length": 24})
  tokenizer = make_tokenizer(cfg)
  learner = make_learner(
    cfg, Model(model_config(cfg, tokenizer)), make_mesh(jax.devices()[:4], axes)
  )
  if not pinned:
    learner.activation_sharding = None
  return learner, tokenizer.vocab_size


def _demo_batch(vocab: int):
  from jaxrl.train import TrainBatch

  rng = np.random.default_rng(0)
  size, length, prompt = 128, 21, 12
  mask = np.zeros((size, length - 1), np.float32)
  mask[:, prompt:] = 1
  return TrainBatch(
    tokens_bt=rng.integers(3, vocab, (size, length)).astype(np.int32),
    mask_bt=mask,
    old_logp_bt=np.log(rng.uniform(0.05, 0.9, mask.shape)).astype(np.float32) * mask,
    advantages_b=rng.normal(size=size).astype(np.float32),
  )


def _updates(axes: dict, repeats: int) -> dict:
  learners = {pinned: _demo_learner(axes, pinned) for pinned in (True, False)}
  batch = _demo_batch(learners[True][1])
  times = {True: [], False: []}
  for i in range(repeats + 2):
    for pinned, (learner, _) in learners.items():
      start = time.perf_counter()
      jax.block_until_ready(learner.update(batch))
      if i >= 2:
        times[pinned].append(time.perf_counter() - start)
  return {pinned: statistics.median(ts) for pinned, ts in times.items()}


def bench_collectives(length: int = 4096, repeats: int = 10) -> dict:
  if len(jax.devices()) < 8:
    raise SystemExit(
      f"bench collectives needs 8 devices (8 simulated CPU ones), got {jax.devices()}."
    )
  out = {}
  for axes in PLAN_MESHES:
    for pinned in (True, False):
      out[f"plan_qwen3-0.6b_{_name(axes)}_{'pinned' if pinned else 'free'}"] = _plan(
        axes, pinned, length
      )
  for axes in UPDATE_MESHES:
    seconds = _updates(axes, repeats)
    for pinned in (True, False):
      out[f"update_{_name(axes)}_{'pinned' if pinned else 'free'}"] = {"median_s": seconds[pinned]}
  return out
