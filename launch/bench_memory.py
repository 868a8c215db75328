"""`python launch/bench.py memory`: host memory of a GRPO step with Qwen3-0.6B shapes on CPU.

The checkpoint is a random-weight `qwen3-0.6b` preset written with `save_pretrained` (bf16,
1.19 GB) and loaded back by the job (`configs/grpo_hf.py:qwen3-0.6b` with `pretrained.path`
pointing at it). The step: 4 prompts x 4 responses x 256 generated tokens (EOS ignored, so
every response has 256), one optimizer update over micro-batches of 4, rollout and learner on
one CPU device (colocated), the byte tokenizer (the checkpoint has no tokenizer files; ids past
its 259 are masked out of sampling, as padded embedding rows are).

Each case runs in a fresh process (peak resident memory, `ru_maxrss`, is per process):
- `load`: loading alone, the peak resident memory it adds against the checkpoint's size on disk
  (target: at most 1.5x);
- `grpo_step`: the step with the recipe's memory options on (fp32 master weights and Adam
  second moment, bf16 first moment and gradient sum, chunked log-probs, remat, bf16 rollout
  weights, rollout weights and KV pool freed during the update), micro-batches of 1 sequence:
  `peak_rss_gib` (target: at most 12) and the wall time split by stage (`time_wait` for the
  rollout, `time_train`, ...; the step compiles its shapes, so the times include compilation);
- `learner_plan_<option>_micro<m>`: XLA's buffer plan of that step's optimizer update (compiled,
  not run: a step on this CPU takes many minutes) with each memory option off in turn, at
  micro-batches of 1 and 4 sequences: GiB of arguments (parameters, Adam state) and
  temporaries (gradients, activations, logits).

On an accelerator, `python launch/bench_memory.py write DIR` then
`python launch/bench_memory.py recipe_steps:N DIR ['{"key": value}']` run N steps of the recipe
as shipped (bf16) from that checkpoint, with any more config overrides given as JSON, and print
each step's time split and the device's peak memory.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)

# The recipe's memory options, each turned off in turn (name -> config overrides).
OPTIONS_OFF = {
  "all_on": {},
  "logprob_chunk_off": {"train.logprob_chunk": 1 << 20},  # one chunk: whole-sequence logits
  "remat_off": {"model.remat": False},
  "mu_bf16_off": {"train.optimizer.mu_dtype": "float32"},  # Adam's first moment in fp32
  "grad_bf16_off": {"train.optimizer.grad_accum_dtype": "float32"},  # gradient sum in fp32
}

WORKLOAD = {
  "tokenizer": "byte",
  "model.dtype": "float32",  # XLA:CPU has no fast bf16 matmuls; memory is what this measures
  "rollout.prompts_per_step": 4,
  "rollout.group_size": 4,
  "rollout.sampling.max_new_tokens": 256,
  "rollout.sampling.ignore_eos": True,
  "rollout.paged.num_pages": 400,  # the step's 16 x (prompt + 256) tokens, in pages of 16
  "rollout.paged.max_running": 16,
  "train.steps": 1,
  "train.updates_per_step": 1,
  "train.micro_batch_size": 1,
  "eval.every": 0,
  "checkpoint.every": 0,
}


def _rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _current_rss_gib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _write_checkpoint(path: str) -> dict:
  import jax

  from jaxrl.model import Model, get_preset, save_pretrained

  model = Model(get_preset("qwen3-0.6b", param_dtype="bfloat16"))
  params = jax.jit(model.init)(0)
  save_pretrained(model, params, path, dtype="bfloat16")
  size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
  return {"checkpoint_bytes": size}


def _load(path: str) -> dict:
  import jax

  from jaxrl.model import load_pretrained

  jax.devices()  # the backend's own memory is not the loader's
  before = _current_rss_gib()
  start = time.perf_counter()
  _, params = load_pretrained(path, dtype="bfloat16")
  jax.block_until_ready(params)
  size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if "safetensors" in f)
  added = _rss_gib() - before
  return {
    "load_s": round(time.perf_counter() - start, 1),
    "checkpoint_gib": round(size / 2**30, 3),
    "load_peak_added_gib": round(added, 3),
    "load_peak_over_size": round(added * 2**30 / size, 3),
  }


def _step(path: str) -> dict:
  import jax

  jax.config.update("jax_num_cpu_devices", 1)
  from jaxrl.config import load_config
  from jaxrl.metrics import read_metrics
  from jaxrl.rl import job

  overrides = {**WORKLOAD, "pretrained.path": path}
  cfg = load_config(os.path.join(_REPO, "configs", "grpo_hf.py"), "qwen3-0.6b", overrides)
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    controller = job.build_controller(cfg, workdir, show_progress=False)
    build_s = time.perf_counter() - start
    controller.run(until=1)
    (metrics,) = [r for r in read_metrics(controller.writer.path) if r["kind"] == "train"]
  times = {k: round(v, 1) for k, v in metrics.items() if k.startswith("time_")}
  return {"peak_rss_gib": round(_rss_gib(), 2), "build_and_load_s": round(build_s, 1), **times}


def _recipe_steps(path: str, steps: int, extra: dict) -> None:
  """The recipe as shipped (bf16 compute, its lengths and batch) on the default backend, meant
  for an accelerator: `steps` GRPO steps on the sample math data with the byte tokenizer,
  printing each step's time split and the device's peak memory as a JSON line when it ends
  (compilation is in step 1, cold: no persistent compilation cache unless `extra` names a
  `compile_cache_dir`, which is then used as `job.run` uses it). `extra`: more config
  overrides."""
  import jax

  from jaxrl.compile_cache import use_compile_cache
  from jaxrl.config import load_config
  from jaxrl.metrics import read_metrics
  from jaxrl.rl import job

  overrides = {
    "pretrained.path": path,
    "tokenizer": "byte",
    "train.steps": steps,
    "eval.every": 0,
    "checkpoint.every": 0,
    "checkpoint.hf_every": 0,
    "compile_cache_dir": "",
    **extra,
  }
  cfg = load_config(os.path.join(_REPO, "configs", "grpo_hf.py"), "qwen3-0.6b", overrides)
  use_compile_cache(cfg.compile_cache_dir)
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    controller = job.build_controller(cfg, workdir, show_progress=False)
    print(json.dumps({"build_and_load_s": round(time.perf_counter() - start, 1)}), flush=True)

    def report(c) -> None:  # after each step: its metrics and the device's peak so far
      metrics = [r for r in read_metrics(c.writer.path) if r["kind"] == "train"][-1]
      stats = jax.devices()[0].memory_stats() or {}
      line = {k: round(float(v), 3) for k, v in metrics.items() if k.startswith("time_")}
      line |= {"step": metrics["step"], "wall_s": round(metrics["time_step"], 2)}
      line["peak_device_gib"] = round(stats.get("peak_bytes_in_use", 0) / 2**30, 2)
      line["response_length"] = round(metrics["response_length"], 1)
      print(json.dumps(line), flush=True)

    controller.on_step.append(report)
    controller.run(until=steps)


def _learner_plan(path: str, case: str, micro_batch: int) -> dict:
  """XLA's buffer plan of the step's optimizer update (`Learner.update_memory`), compiled but
  not run, with the memory option `case` turned off."""
  import jax

  jax.config.update("jax_num_cpu_devices", 1)
  from jaxrl.config import load_config
  from jaxrl.model import Model
  from jaxrl.rl import stages
  from jaxrl.rl.policy import make_tokenizer, model_config
  from jaxrl.sharding import make_mesh

  overrides = {**WORKLOAD, **OPTIONS_OFF[case], "pretrained.path": path}
  overrides["train.micro_batch_size"] = micro_batch
  # Packed rows as the step's job sizes them: 136-token prompt + 256 tokens - 1, rounded to 8.
  overrides["train.pack_length"] = 392
  cfg = load_config(os.path.join(_REPO, "configs", "grpo_hf.py"), "qwen3-0.6b", overrides)
  model = Model(model_config(cfg, make_tokenizer(cfg)))
  mesh = make_mesh(jax.devices()[:1], {"fsdp": -1})
  learner = stages.make_learner(cfg, model, mesh)
  plan = learner.update_memory(16, 392)  # 16 sequences of prompt (~136) + 256 tokens
  return {k: round(v, 2) for k, v in plan.items()}


def bench_memory() -> dict:
  """Runs every case in its own process; returns case -> figures."""
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "qwen3-0.6b-random")
    out["checkpoint"] = _child("write", path)
    out["load"] = _child("load", path)
    out["grpo_step"] = _child("step", path)
    for case in OPTIONS_OFF:
      for micro in (1, 4):
        out[f"learner_plan_{case}_micro{micro}"] = _child(f"plan:{case}:{micro}", path)
  out["target_peak_rss_gib"] = 12
  out["target_load_peak_over_size"] = 1.5
  return out


def _child(case: str, path: str) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), case, path]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
  if done.returncode:
    return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(case: str, path: str, extra: str = "{}") -> None:
  sys.path.insert(0, _REPO)
  if case.startswith("recipe_steps"):  # prints its own lines, one per step
    _recipe_steps(path, int(case.split(":")[1]), json.loads(extra))
    return
  if case == "write":
    result = _write_checkpoint(path)
  elif case == "load":
    result = _load(path)
  elif case == "step":
    result = _step(path)
  else:
    _, option, micro = case.split(":")
    result = _learner_plan(path, option, int(micro))
  print(json.dumps(result))


if __name__ == "__main__":
  if not sys.argv[1].startswith("recipe_steps"):  # the recipe's steps run on the accelerator
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main(*sys.argv[1:])
