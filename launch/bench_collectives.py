"""`python launch/bench.py collectives`: what a training mesh's layout costs in communication,
each layout as the learner runs it beside its baseline in the same run:

- meshes with an fsdp axis: the residual stream pinned between blocks
  (`Learner.activation_sharding`; `pinned`) against left to XLA (`free`: the learner before
  2026-11-27);
- data-parallel meshes: each replica's gradient sums kept apart until the apply step
  (`jaxrl.train.replica_sums`; `replica_sums`) against summed across replicas in every
  micro-step (`each_micro_step`: before 2026-11-27).

Rows:
- `plan_qwen3-0.6b_<mesh>_<variant>`: the packed update of a Qwen3-0.6B-shaped learner (bf16
  compute, fp32 master weights, bf16 gradient sums, remat, dense attention, one row of
  `length` positions per device) compiled for 8 CPU devices and not run: per program (the
  micro-step, run once per micro-batch, and the apply step, once an update) and kind of
  collective, how many and the MiB their results take on each device
  (`update_plan.collective_traffic`), and the micro-step's temporaries. The SPMD partitioner
  that decides what crosses devices runs before any backend's code generation, so 8 GPUs or TPU
  chips with the same mesh get the same collectives; XLA:CPU writes a gradient's
  reduce-scatter as an all-reduce, which a GPU or TPU compile turns into a reduce-scatter.
  `plan_qwen3-0.6b_data8_padded_<variant>`: the padded update (`train.pack_length=0`: one
  program, a scan over 2 micro-batches of a row a device): the MiB of collectives a device
  runs once an update (the program's top-level computation) and in every micro-batch (in the
  scan's body).
- `update_<mesh>_<variant>`: the demo's learner update (`configs/grpo_tiny.py`: its tiny model,
  128 sequences of 21 tokens, packed rows of 24 positions, 2 optimizer updates of 2
  micro-batches) run on 4 CPU devices: median seconds of `repeats` updates after 2 warm ones,
  the two variants taking turns. `update_data4_padded_<variant>`: the same with padded
  micro-batches (`train.pack_length=0`: one update program, a scan over the micro-batches).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from unittest import mock

import jax
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_MESHES = ({"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 8})
# (mesh, pack_length) of the demo's update: packed rows of 24 positions, or padded (0).
UPDATE_CASES = (({"fsdp": 4}, 24), ({"data": 4}, 24), ({"data": 4}, 0))
# (as shipped, baseline) per kind of mesh.
VARIANTS = {"fsdp": ("pinned", "free"), "data": ("replica_sums", "each_micro_step")}


def _name(axes: dict) -> str:
  return "x".join(f"{axis}{size}" for axis, size in axes.items())


def _variants(axes: dict) -> tuple[str, str]:
  return VARIANTS["data" if set(axes) == {"data"} else "fsdp"]


def _baseline(variant: str):
  """While a learner is built: the replicas' sums summed every micro-step (`each_micro_step`);
  nothing otherwise (`free` is set on the built learner)."""
  if variant != "each_micro_step":
    return contextlib.nullcontext()
  from jaxrl.train import replica_sums

  return mock.patch.object(replica_sums, "replicas", lambda config, mesh: 0)


def _unpin(learner, variant: str):
  if variant == "free":
    learner.activation_sharding = None  # XLA's own choice
  return learner


def _plan(axes: dict, variant: str, length: int, padded: bool = False) -> dict:
  from jaxrl.model import Model, get_preset
  from jaxrl.sharding import TRAIN_RULES, make_mesh
  from jaxrl.train import Learner, LossConfig, OptimizerConfig, update_plan

  cfg = get_preset(
    "qwen3-0.6b", dtype="bfloat16", param_dtype="float32", remat=True, attention="dense",
    max_seq_len=length + 1,
  )  # fmt: skip
  devices = jax.devices()[:8]
  with _baseline(variant):
    learner = Learner(
      Model(cfg),
      make_mesh(devices, axes),
      TRAIN_RULES,
      loss=LossConfig(),
      optimizer=OptimizerConfig(mu_dtype="bfloat16", grad_accum_dtype="bfloat16"),
      updates_per_step=1,
      micro_batch_size=len(devices),
      temperature=1.0,
      pack_length=0 if padded else length,
      abstract=True,
    )
  _unpin(learner, variant)
  start = time.perf_counter()
  if padded:  # one program: a scan over 2 micro-batches of a row a device
    (program,) = update_plan.compiled_update(learner, 2 * len(devices), length + 1)
    mib = lambda text: sum(c.bytes for c in update_plan.collective_results(text)) / 2**20  # noqa: E731
    once = mib(update_plan.entry_computation(program.as_text()))
    return {
      "update_once_collective_mib": once,
      "update_each_micro_batch_collective_mib": mib(program.as_text()) - once,
      "update_temporaries_gib": program.memory_analysis().temp_size_in_bytes / 2**30,
      "compile_s": time.perf_counter() - start,
    }
  programs = update_plan.compiled_update(learner, len(devices), length + 1)
  row = {}
  for name, program in zip(("micro_step", "apply"), programs, strict=True):
    traffic = update_plan.collective_traffic([program])
    row |= {f"{name}_{kind}_{k}": v for kind, entry in traffic.items() for k, v in entry.items()}
    row[f"{name}_collective_mib"] = sum(entry["mib"] for entry in traffic.values())
  row["micro_step_temporaries_gib"] = programs[0].memory_analysis().temp_size_in_bytes / 2**30
  row["compile_s"] = time.perf_counter() - start
  return row


def _demo_learner(axes: dict, variant: str, pack_length: int):
  from jaxrl.config import load_config
  from jaxrl.model import Model
  from jaxrl.rl.policy import make_tokenizer, model_config
  from jaxrl.rl.stages import make_learner
  from jaxrl.sharding import make_mesh

  overrides = {"train.pack_length": pack_length}
  cfg = load_config(os.path.join(_REPO, "configs", "grpo_tiny.py"), None, overrides)
  tokenizer = make_tokenizer(cfg)
  model = Model(model_config(cfg, tokenizer))
  with _baseline(variant):
    learner = make_learner(cfg, model, make_mesh(jax.devices()[:4], axes))
  return _unpin(learner, variant), tokenizer.vocab_size


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


def _updates(axes: dict, repeats: int, pack_length: int) -> dict:
  learners = {variant: _demo_learner(axes, variant, pack_length) for variant in _variants(axes)}
  batch = _demo_batch(next(iter(learners.values()))[1])
  times = {variant: [] for variant in learners}
  for i in range(repeats + 2):
    for variant, (learner, _) in learners.items():
      start = time.perf_counter()
      jax.block_until_ready(learner.update(batch))
      if i >= 2:
        times[variant].append(time.perf_counter() - start)
  return {variant: statistics.median(ts) for variant, ts in times.items()}


def bench_collectives(length: int = 4096, repeats: int = 20) -> dict:
  if len(jax.devices()) < 8:
    raise SystemExit(
      f"bench collectives needs 8 devices (8 simulated CPU ones), got {jax.devices()}."
    )
  out = {}
  for axes in PLAN_MESHES:
    for variant in _variants(axes):
      out[f"plan_qwen3-0.6b_{_name(axes)}_{variant}"] = _plan(axes, variant, length)
  for variant in _variants({"data": 8}):
    out[f"plan_qwen3-0.6b_data8_padded_{variant}"] = _plan({"data": 8}, variant, length, True)
  for axes, pack_length in UPDATE_CASES:
    padded = "" if pack_length else "_padded"
    for variant, seconds in _updates(axes, repeats, pack_length).items():
      out[f"update_{_name(axes)}{padded}_{variant}"] = {"median_s": seconds}
  return out
