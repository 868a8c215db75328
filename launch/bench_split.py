"""`python launch/bench.py split_kernels --json`: what the kernels' split over a mesh saves
(`jaxrl.kernels.partitioning`), compiled for GPUs without them.

Each set-up is compiled twice in one process: with the kernels split over the mesh as their
operands are (as shipped), and with `unsplit_kernels()` (one whole custom call each, which
XLA's partitioner gathers onto every device: how the kernels ran before). Reported per
program: the collectives in its text by kind (count, and the bytes of their results on one
device; a decode window's loop body is its decode step, so those are a step's), XLA's
temporaries on one device, and the compile's seconds.

Set-ups, the ones a user with a node of GPUs meets:
- `engine_qwen3-8b_tensor2`: the paged engine of Qwen3-8B over 2 GPUs in tensor parallel
  (bf16 weights and KV, 64 rows, 2,048-token page tables, 4,096 pages of 16, flash attention's
  kernel): its decode window (without a sampling filter, and as shipped only, with top-k:
  `decode_step_top_k`, and with top-p alone: `decode_step_top_p`), and its packed prefill of
  the most rows (prompts of up to 512 tokens packed into rows of 512).
- `learner_qwen3-0.6b_fsdp8`: the learner's micro-step of Qwen3-0.6B over 8 GPUs in fsdp (bf16
  compute, fp32 master weights, remat keeping attention's output and statistics as the HF
  recipe does, flash attention's Pallas kernel, one packed row of 4,096 positions a GPU). Also
  reported: how many times the program runs each flash kernel.

- `moe_qwen3-30b-a3b_2_layers_expert4`: Qwen3-30B-A3B's first 2 layers over 4 devices of an
  expert axis alone (routing replay): the learner's micro-step (one packed row of 1,024) and
  the engine's decode window (16 rows). Nothing there for the kernels to split.

`--target tpu-v5e` compiles the same for a TPU topology's chips (the learner over its 4 chips).
Needs the CUDA plugin or libtpu next to jax (`launch/bench_kernels.py`, PLUGIN_HELP, TPU_HELP).
"""

from __future__ import annotations

import re
import time

import numpy as np

_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_KINDS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_ARRAY = re.compile(r"\b(bf16|f16|f32|s32|u32|s8|u8|pred)\[([\d,]*)\]")


def collectives(hlo: str) -> dict:
  """{kind: {"count", "bytes"}} of the collectives in a compiled program's text; bytes: their
  results on one device (an async start's type lists its operands, then its results)."""
  out = {}
  for kind in _KINDS:
    for match in re.finditer(rf"= (.+?) {kind}(-start)?\(", hlo):
      arrays = _ARRAY.findall(match[1])
      if match[2] and kind != "all-reduce":
        arrays = arrays[len(arrays) // 2 :]
      size = sum(
        _DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))
        for dt, dims in arrays
      )
      row = out.setdefault(kind, {"count": 0, "bytes": 0})
      row["count"] += 1
      row["bytes"] += size
  return out


def _measure(compile_program) -> dict:
  from bench_kernels import flash_kernel_calls

  start = time.perf_counter()
  compiled = compile_program()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  row = {
    "collectives": collectives(text),
    "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
    "compile_s": round(seconds, 1),
  }
  if calls := flash_kernel_calls(text):  # a remat policy that keeps attention's residuals
    row["flash_kernel_calls"] = calls  # runs the forward kernel once a layer, not twice
  return row


def _both(compile_program) -> dict:
  """The program (`compile_program()` traces and compiles it) compiled as shipped and with
  the kernels unsplit, in this process."""
  import contextlib

  from jaxrl.kernels.partitioning import unsplit_kernels

  row = {}
  for name, setting in (("split", contextlib.nullcontext), ("unsplit", unsplit_kernels)):
    try:
      with setting():
        row[name] = _measure(compile_program)
    except Exception as e:  # noqa: BLE001  (a compiler error is this benchmark's finding)
      row[name] = {"error": str(e).splitlines()[0][:500]}
  return row


def _engine(target: str) -> dict:
  from bench_kernels import _target_devices

  from jaxrl.compile_ahead import with_shardings
  from jaxrl.model import Model, get_preset
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.rollout.precompile import engine_lowerings
  from jaxrl.rollout.sampling import NO_FILTER, SORT_ALL, TOP_K_CANDIDATES
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh

  mesh = make_mesh(_target_devices(target, 2)[:2], {"tensor": 2})
  cfg = get_preset("qwen3-8b", dtype="bfloat16", param_dtype="bfloat16", attention="flash")
  model = Model(cfg)
  config = PagedConfig(page_size=16, num_pages=4096, max_running=64, prefill_chunk=512,
                       max_tokens=2048, keep_turn_kv=False)  # fmt: skip
  engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
  params = with_shardings(model.abstract_params(), engine.param_shardings)
  lowerings = engine_lowerings(engine, 1, NO_FILTER, params)
  packed = engine._calls._prefill_packed
  # The most rows and the widest page table; the packed prefill of the most rows.
  first = lambda pair: pair[0]  # noqa: E731
  decode = max(((p.args[2].shape, lower) for p, lower in lowerings if p.on_device), key=first)
  prefills = ((p.args[0].shape, lower) for p, lower in lowerings if p.jitted is packed)
  prefill = max(prefills, key=first)
  # The same step sampling with a top-k filter (`TOP_K_CANDIDATES`: Qwen3's generation
  # config asks for top_k 20), as shipped only.
  top_k = engine_lowerings(engine, 1, TOP_K_CANDIDATES, params)
  decode_top_k = max(((p.args[2].shape, lower) for p, lower in top_k if p.on_device), key=first)
  # And with a nucleus of no fixed size (top-p without top-k: `SORT_ALL`), as shipped only.
  top_p = engine_lowerings(engine, 1, SORT_ALL, params)
  decode_top_p = max(((p.args[2].shape, lower) for p, lower in top_p if p.on_device), key=first)
  return {
    "decode_step": {
      "rows": decode[0][0],
      "table_pages": decode[0][1],
      **_both(lambda: decode[1]().compile()),
    },
    "decode_step_top_k": {
      "rows": decode_top_k[0][0],
      "split": _measure(lambda: decode_top_k[1]().compile()),
    },
    "decode_step_top_p": {
      "rows": decode_top_p[0][0],
      "split": _measure(lambda: decode_top_p[1]().compile()),
    },
    "packed_prefill": {
      "rows": prefill[0][0],
      "tokens": prefill[0][1],
      **_both(lambda: prefill[1]().compile()),
    },
  }


def _learner_micro_step(target: str) -> dict:
  from bench_kernels import TPU_TOPOLOGIES, _target_devices
  from bench_moe import abstract_learner

  from jaxrl.model import get_preset
  from jaxrl.sharding import make_mesh
  from jaxrl.train import update_plan

  length = 4096
  devices = _target_devices(target, 8)  # a TPU target: its topology's chips (4)
  gpus = len(devices) if target in TPU_TOPOLOGIES else 8
  mesh = make_mesh(devices[:gpus], {"fsdp": gpus})
  cfg = get_preset("qwen3-0.6b", dtype="bfloat16", param_dtype="float32", remat=True,
                   remat_policy="save_attention", max_seq_len=length + 1,
                   attention="flash")  # fmt: skip
  learner = abstract_learner(cfg, mesh, length, rows=gpus)

  def micro_step():
    return update_plan.compiled_update(learner, 2 * gpus, length)[0]

  return {"gpus": gpus, "pack_length": length, **_both(micro_step)}


def _moe_expert_parallel(target: str) -> dict:
  """Qwen3-30B-A3B's first 2 layers over 4 devices of an expert axis alone (nothing for the
  kernels to split: each device attends with every row and head), the learner's micro-step
  and the engine's decode window: whether they compile."""
  from bench_kernels import _target_devices
  from bench_moe import abstract_learner

  from jaxrl.compile_ahead import with_shardings
  from jaxrl.model import Model, get_preset
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.rollout.precompile import engine_lowerings
  from jaxrl.rollout.sampling import NO_FILTER
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh
  from jaxrl.train import update_plan

  mesh = make_mesh(_target_devices(target, 4)[:4], {"expert": 4})
  length = 1024
  common = dict(dtype="bfloat16", attention="flash", num_layers=2, moe_dispatch="dense")
  train_cfg = get_preset("qwen3-30b-a3b", param_dtype="float32", remat=True,
                         max_seq_len=length + 1, **common)  # fmt: skip
  learner = abstract_learner(train_cfg, mesh, length, replay=True)
  model = Model(get_preset("qwen3-30b-a3b", param_dtype="bfloat16", **common))
  config = PagedConfig(page_size=16, num_pages=1024, max_running=16, prefill_chunk=256,
                       max_tokens=512, keep_turn_kv=False)  # fmt: skip
  engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
  params = with_shardings(model.abstract_params(), engine.param_shardings)
  lowerings = engine_lowerings(engine, 1, NO_FILTER, params)
  decode = next(lower for p, lower in lowerings if p.on_device)

  def micro_step():
    return update_plan.compiled_update(learner, 2, length)[0]

  return {
    "learner_micro_step": _both(micro_step),
    "decode_step": _both(lambda: decode().compile()),
  }


def plan_split_kernels(spec: dict) -> dict:
  """In a fresh process (`bench_kernels._run_child`): the set-ups of this module's docstring,
  each compiled split and unsplit for `spec["target"]`: GPUs, or a TPU topology's chips."""
  from bench_kernels import TPU_TOPOLOGIES

  from jaxrl.kernels.common import target_platform

  out = {}
  with target_platform("tpu" if spec["target"] in TPU_TOPOLOGIES else "cuda"):
    for name, plan in (
      ("engine_qwen3-8b_tensor2", _engine),
      ("learner_qwen3-0.6b_fsdp8", _learner_micro_step),
      ("moe_qwen3-30b-a3b_2_layers_expert4", _moe_expert_parallel),
    ):
      if spec.get("only") and name not in spec["only"]:
        continue
      try:
        out[name] = plan(spec["target"])
      except Exception as e:  # noqa: BLE001
        out[name] = {"error": str(e).splitlines()[0][:500]}
  return out


def bench_split_kernels(target: str = "h100") -> dict:
  """`plan_split_kernels` in a child process with the CUDA plugin's compiler (or libtpu's, for
  a TPU target)."""
  from bench_kernels import _run_child

  return {"target": target, **_run_child({"target": target, "kind": "split_kernels"}, 3600.0)}
