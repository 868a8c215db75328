"""`python launch/bench.py learner`: the learner's tokens/s, MFU and peak memory on packed rows.

One optimizer update per step (GRPO loss, bf16 compute on fp32 master weights, bf16 Adam first
moment and gradient sums, remat, chunked log-probs: `configs/grpo_hf.py`'s learner) of
Qwen3-0.6B shapes, random weights, on one device. Each micro-batch is one packed row of
`length` positions (4k and 16k) holding one sequence that fills it (a 256-token prompt and its
response: the reasoning-length case, where attention costs most); `rows` micro-batches per
update. Attention `flash` (`jaxrl.kernels.flash_attention`, the Pallas kernel) and `cudnn`
(the same through cuDNN's fused attention, packed layout) at both lengths, and `dense` at 16k
for its memory (`SETTINGS`).

Each setting runs in a process of its own, so that its peak device memory
(`memory_stats()["peak_bytes_in_use"]`) is its own; a setting that runs out of memory is
reported as such. Also reported: XLA's buffer plan of the update (`Learner.update_memory`).

MFU: model FLOPs over time, over the card's dense bf16 peak (989 TFLOP/s for an H100 or H200
SXM) and over a 8192^3 bf16 matmul of random data measured in the same process (1024^3 on CPU).
Model FLOPs of a sequence of L tokens = 6 N L + 6 layers heads head_dim L^2 (N parameters,
embedding included; causal attention forward and backward), the convention of the anchor the
issue cites (11.1% MFU at 11.9k tok/s for Qwen3-0.6B at 16k tokens on one H100 is this formula
over 989 TFLOP/s).
On CPU the command runs `bench-tiny` at 256 and 1,024 positions, fp32, so that it runs anywhere.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


def recipe_learner(
  preset: str,
  length: int,
  attention: str,
  devices,
  *,
  dtype,
  abstract=False,
  logprob_chunk=128,
  remat_policy="full",
  scan_layers=True,
):
  """(model config, `Learner`) of this benchmark's recipe on the first of `devices`: one
  packed row of `length` positions per micro-batch, fp32 master weights, `dtype` compute,
  bf16 Adam first moment and gradient sums, remat (keeping what `remat_policy` names), the LM
  head applied `logprob_chunk` positions at a time, the blocks scanned (`scan_layers`) or
  unrolled. `abstract`: shapes only (`Learner`), for planning on devices this process does
  not have (`launch/bench_kernels.py`)."""
  from jaxrl.model import Model, get_preset
  from jaxrl.sharding import TRAIN_RULES, make_mesh
  from jaxrl.train import Learner, LossConfig, OptimizerConfig

  cfg = get_preset(
    preset,
    dtype=dtype,
    param_dtype="float32",
    remat=True,
    remat_policy=remat_policy,
    attention=attention,
    max_seq_len=length + 1,
    scan_layers=scan_layers,
  )
  model = Model(cfg)
  learner = Learner(
    model,
    make_mesh(devices[:1], {}),
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(mu_dtype="bfloat16", grad_accum_dtype="bfloat16"),
    updates_per_step=1,
    micro_batch_size=1,
    temperature=1.0,
    params=None if abstract else model.init(0),
    pack_length=length,
    abstract=abstract,
    logprob_chunk=logprob_chunk,
  )
  return cfg, learner


def _child(setting: dict) -> dict:
  """One setting, in this process: compile, then time `steps` updates."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl.train import TrainBatch

  on_cpu = jax.default_backend() == "cpu"
  length, attention, rows = setting["length"], setting["attention"], setting["rows"]
  dtype = "float32" if on_cpu else "bfloat16"
  cfg, learner = recipe_learner(
    setting["preset"], length, attention, jax.devices(), dtype=dtype,
    logprob_chunk=setting.get("logprob_chunk", 128),
    remat_policy=setting.get("remat_policy", "full"),
    scan_layers=setting.get("scan_layers", True),
  )  # fmt: skip
  rng = np.random.default_rng(0)
  prompt = min(256, length // 4)
  tokens = rng.integers(3, cfg.vocab_size, (rows, length + 1)).astype(np.int32)
  mask = np.zeros((rows, length), np.float32)
  mask[:, prompt - 1 :] = 1.0
  old = np.where(mask > 0, rng.normal(-2.0, 0.5, mask.shape), 0.0).astype(np.float32)
  batch = TrainBatch(tokens, mask, old, rng.normal(size=rows).astype(np.float32))
  plan = learner.update_memory(rows, length + 1)
  start = time.perf_counter()
  jax.block_until_ready(learner.update(batch))
  first_s = time.perf_counter() - start
  times = []
  for _ in range(setting["steps"]):
    start = time.perf_counter()
    jax.block_until_ready(learner.update(batch))
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  # The card's matmul rate, on random data; a CPU (the fallback run) gets a size it does in
  # seconds, not minutes.
  size = 1024 if on_cpu else 8192
  a = jnp.asarray(rng.standard_normal((size, size), np.float32), jnp.bfloat16)
  mm = jax.jit(lambda x: x @ x)
  jax.block_until_ready(mm(a))
  start = time.perf_counter()
  jax.block_until_ready([mm(a) for _ in range(10)])
  matmul_flops = 2 * size**3 * 10 / (time.perf_counter() - start)
  seq_tokens = length + 1
  model_flops = rows * (
    6 * cfg.num_params() * seq_tokens
    + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_tokens**2
  )
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", "")
  peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)
  stats = device.memory_stats() or {}
  profile = _profile_update(learner, batch) if setting.get("profile") else None
  return {
    **setting,
    "device": kind,
    "first_step_s": first_s,
    "step_s": step_s,
    "tokens_per_s": rows * seq_tokens / step_s,
    "model_tflops": model_flops / step_s / 1e12,
    "mfu": model_flops / step_s / (peak * 1e12) if peak else None,
    "of_measured_bf16_matmul": model_flops / step_s / matmul_flops,
    "bf16_matmul_tflops": matmul_flops / 1e12,
    "peak_device_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None,
    "plan_gib": plan,
    **({"profile": profile} if profile is not None else {}),
  }


def _profile_update(learner, batch) -> dict:
  """One more update under `jax.profiler`: its device kernels by kind (`bench_profile`), and
  the device's busy time against the update's wall time under the profiler."""
  from bench_profile import device_kernels, run_profiled, summarize  # launch/ is on sys.path

  seconds, trace = run_profiled(lambda: learner.update(batch))
  kernels = device_kernels(trace)
  out = {"wall_ms_profiled": seconds * 1e3}
  out.update(summarize(kernels, 1, top=30) if kernels else {"device_events": 0})
  return out


# (positions, attention)
SETTINGS = (
  (4096, "flash"), (4096, "cudnn"), (16384, "flash"), (16384, "cudnn"), (16384, "dense"),
)  # fmt: skip


def bench_learner(
  settings=SETTINGS,
  rows: int = 2,
  steps: int = 3,
  timeout_s: float = 400.0,
  profile=False,
  logprob_chunks: tuple[int, ...] = (128,),
  remat_policies: tuple[str, ...] = ("full",),
):
  """Each setting's tokens/s, MFU and memory (module docstring); `profile`: also one update's
  device kernels by kind (`_profile_update`: where the update's time goes). Each setting runs
  at each of `logprob_chunks` (positions of the LM head applied at a time; the learner's
  default 128): each chunk re-reads the 311 MB embedding of Qwen3-0.6B four times and adds to
  its gradient, so small chunks cost memory traffic, large ones memory (rows named
  `.../chunk<N>` when more than one is given), and at each of `remat_policies`
  (`ModelConfig.remat_policy`: what a rematerialised block keeps; rows named
  `.../remat-<policy>` when more than one is given)."""
  import jax

  # This process only starts the settings' processes: it must not take the device's memory
  # (JAX preallocates 75% of a GPU's at its first use), which they need.
  child_env = dict(os.environ)
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  preset = "qwen3-0.6b"
  if jax.default_backend() == "cpu":
    preset, settings = "bench-tiny", ((256, "flash"), (1024, "flash"), (1024, "dense"))
  out = {}
  for (length, attention), chunk, policy in itertools.product(
    settings, logprob_chunks, remat_policies
  ):
    setting = {
      "preset": preset, "length": length, "attention": attention, "rows": rows, "steps": steps,
      "profile": profile, "logprob_chunk": chunk, "remat_policy": policy,
    }  # fmt: skip
    name = f"{preset}/{length}/{attention}" + (f"/chunk{chunk}" if len(logprob_chunks) > 1 else "")
    if policy != "full" and attention == "dense":
      continue  # the policies save flash attention's residuals: dense rows would repeat "full"
    name += f"/remat-{policy}" if len(remat_policies) > 1 else ""
    try:
      done = subprocess.run(
        [sys.executable, __file__, json.dumps(setting)],
        capture_output=True, text=True, timeout=timeout_s, env=child_env,
      )  # fmt: skip
    except subprocess.TimeoutExpired:
      out[name] = {**setting, "error": f"did not finish in {timeout_s:.0f} s"}
      print("progress", json.dumps({name: out[name]}), file=sys.stderr, flush=True)
      continue
    if done.returncode != 0:
      tail = done.stderr.strip().splitlines()[-3:]
      oom = "RESOURCE_EXHAUSTED" in done.stderr or "out of memory" in done.stderr.lower()
      out[name] = {**setting, "error": "out of memory" if oom else " | ".join(tail)[-400:]}
      print("progress", json.dumps({name: out[name]}), file=sys.stderr, flush=True)
      continue
    out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    # Each setting as it ends (stderr), so that a run cut short keeps what it measured.
    print("progress", json.dumps({name: out[name]}), file=sys.stderr, flush=True)
  return out


if __name__ == "__main__":
  print(json.dumps(_child(json.loads(sys.argv[1]))))
