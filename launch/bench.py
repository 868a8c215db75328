"""Benchmarks behind docs/BENCHMARKS.md.

  python launch/bench.py rollout [--json] [--presets micro,bench-tiny,bench-small] [--rows 64]
      [--dtype bfloat16]
  python launch/bench.py prefix_sharing|prefill_packing|decode_floor [--json] [--presets ...]
  python launch/bench.py paged_attention|flash_attention|logprobs|gmm|tgmm [--json]
  python launch/bench.py grpo_step|learner_rebuild|precompiled_rollout [--json] [--presets ...]
  python launch/bench.py learner [--json] [--profile] [--lengths 4096] [--attentions flash]
                                [--logprob-chunks 128,1024]
                                [--remat-policies full,save_attention]
  python launch/bench.py kernels [--json] [--presets qwen3-0.6b]   (the CUDA plugin, no GPU)
  python launch/bench.py kernel_code [--json] [--flash-blocks "block_kv_bwd=32;..."]   (idem)
  python launch/bench.py moe_layer|split_kernels|kv_shards [--json] [--target h100]   (idem)
  python launch/bench.py decode_profile [--json] [--presets qwen3-0.6b] [--rows 64]
      [--prompt-len 32] [--reference qk_rope_write,paged_attention] [--trace-dir DIR]
      [--attention-blocks "2,,2,1;1,,2,1"]
  python launch/bench.py logprob_mismatch|plan|calibrate|sampler|async|balance|memory [--json]
  python launch/bench.py collectives [--json]
  python launch/bench.py weight_transfer|publish [--json] [--presets bench-small,qwen3-0.6b]
  python launch/bench.py chaos [--json] [--faults 100,10,10] [--steps 30]
  python launch/bench.py agent|turn_kv [--json] [--steps 6]
  python launch/bench.py window_kv [--json] [--presets gemma3-1b] [--rows 8]

Each benchmark prints a table (or one JSON object with --json) and the machine it ran on.
"""

import argparse
import functools
import importlib
import itertools
import json
import platform
import resource
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_agent import bench_agent, bench_turn_kv  # noqa: E402  (launch/ is on sys.path)
from bench_async import bench_async  # noqa: E402
from bench_attention import bench_flash_attention  # noqa: E402
from bench_balance import bench_balance  # noqa: E402
from bench_collectives import bench_collectives  # noqa: E402
from bench_gmm import bench_gmm, bench_tgmm  # noqa: E402
from bench_grpo import (  # noqa: E402
  bench_grpo_step,
  bench_learner_rebuild,
  bench_precompiled_rollout,
)
from bench_kernel_code import bench_kernel_code, parse_flash_blocks  # noqa: E402
from bench_kernels import bench_kernels  # noqa: E402
from bench_learner import SETTINGS as bench_learner_settings  # noqa: E402
from bench_learner import bench_learner  # noqa: E402
from bench_logprobs import bench_logprobs  # noqa: E402
from bench_memory import bench_memory  # noqa: E402
from bench_prefill import (  # noqa: E402
  bench_prefill_packing,
  bench_prefix_sharing,
  timed_generate,
)
from bench_profile import bench_decode_profile, decode_step_seconds  # noqa: E402
from bench_sampler import bench_sampler  # noqa: E402
from bench_scheduler import bench_calibrate, bench_plan  # noqa: E402
from bench_window_kv import bench_window_kv  # noqa: E402

from jaxrl.kernels.paged_attention import paged_attention  # noqa: E402
from jaxrl.model import Model, get_preset  # noqa: E402
from jaxrl.rl.experience import logprob_mismatch  # noqa: E402
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams, StaticEngine  # noqa: E402
from jaxrl.rollout.engine import bucket  # noqa: E402
from jaxrl.scheduler.cost import kv_bytes, kv_bytes_per_token  # noqa: E402
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh  # noqa: E402
from jaxrl.train import Learner, LossConfig, OptimizerConfig  # noqa: E402


def bench_logprob_mismatch(num_seqs: int = 64, max_new_tokens: int = 32) -> dict:
  """|rollout log-prob - learner log-prob| per generated token, same weights, fp32."""
  devices = jax.devices()
  rollout_mesh = make_mesh(devices[:4], {"data": 2, "tensor": 2})
  train_mesh = make_mesh(devices[4:8], {"fsdp": 4})
  out = {}
  for preset in ("tiny", "tiny-moe"):
    model = Model(get_preset(preset))
    params = model.init(0)
    engine = StaticEngine(model, rollout_mesh, ROLLOUT_RULES, eos_id=2, pad_id=0)
    engine.update_weights(params, 0)
    learner = Learner(
      model,
      train_mesh,
      TRAIN_RULES,
      loss=LossConfig(),
      optimizer=OptimizerConfig(),
      updates_per_step=1,
      micro_batch_size=num_seqs,
      temperature=1.0,
      params=params,
    )
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 60, rng.integers(2, 12))) for _ in range(num_seqs)]
    completions = engine.generate(
      prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), seed=0
    )
    out[preset] = logprob_mismatch(learner, completions, pad_id=0)
  return out


def _best_seconds(fn, repeats: int = 10, rounds: int = 3) -> float:
  """Best mean time of `repeats` calls over `rounds` (the machine is shared and noisy)."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(repeats):
      out = fn()
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / repeats)
  return best


def _memcpy_bytes_per_s(size_mb: int = 256) -> float:
  """Bytes read + written per second by an in-place on-device copy, the bandwidth roofline.

  In place (donated), because copying into a fresh buffer every call measures page faults of
  the new allocation on XLA:CPU (about 6x slower here), not the memory the decode step reads.
  """
  state = {"x": jax.device_put(np.ones(size_mb * 2**18, np.float32), jax.devices()[0])}
  copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # x * 1.0 would be folded away

  def step():
    state["x"] = copy(state["x"])
    return state["x"]

  return 2 * size_mb * 2**20 / _best_seconds(step)


def _matmul_flops_per_s(m: int = 2048, n: int = 2048, k: int = 2048) -> float:
  a = jax.device_put(np.ones((m, k), np.float32), jax.devices()[0])
  b = jax.device_put(np.ones((k, n), np.float32), jax.devices()[0])
  mm = jax.jit(lambda x, y: x @ y)
  return 2 * m * n * k / _best_seconds(lambda: mm(a, b))


def _decode_hbm_s(cfg, rows: int, context: float, bandwidth: float) -> float:
  """The decode step's memory floor: weights + the KV it reads (a sliding-window layer's
  window) over the copy bandwidth."""
  weight_bytes = cfg.num_params() * np.dtype(cfg.param_dtype).itemsize
  return (weight_bytes + rows * kv_bytes(cfg, context)) / bandwidth


def _decode_roofline_s(cfg, rows: int, context: float, bandwidth: float, flops_rate: float):
  """The larger of the step's memory floor and its FLOPs over the matmul rate."""
  return max(_decode_hbm_s(cfg, rows, context, bandwidth), 2 * cfg.num_params() * rows / flops_rate)


def _matmul_only_step_seconds(cfg, rows: int) -> float:
  """Time of a dense model's weight matmuls alone at `rows` rows (q, k, v, o, gate, up, down
  per layer, then the LM head): a floor under the decode step on this backend, with no
  attention, norms or sampling."""
  if cfg.num_experts:
    raise ValueError("The matmul floor is defined for dense models only (num_experts=0).")
  d, q, kv, f = (
    cfg.d_model,
    cfg.num_heads * cfg.head_dim,
    cfg.num_kv_heads * cfg.head_dim,
    cfg.mlp_dim,
  )
  shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)] * cfg.num_layers
  dev = jax.devices()[0]
  weights = [jax.device_put(np.full(s, 1e-3, np.float32), dev) for s in shapes]
  head = jax.device_put(np.full((d, cfg.vocab_size), 1e-3, np.float32), dev)
  x = jax.device_put(np.ones((rows, d), np.float32), dev)

  @jax.jit
  def chain(x, weights, head):
    for i in range(cfg.num_layers):
      wq, wk, wv, wo, wg, wu, wd = weights[7 * i : 7 * i + 7]
      a = x @ wq + jnp.sum(x @ wk) + jnp.sum(x @ wv)  # k and v feed the cache
      x = x + a @ wo
      x = x + (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
    return x @ head

  return _best_seconds(lambda: chain(x, weights, head))


def bench_decode_floor(
  presets=("bench-small",), rows: int = 16, prompt_len: int = 32, new_tokens: int = 64
):
  """The paged engine's decode step against its roofline and against the model's weight
  matmuls alone, all measured in one run (one device)."""
  bandwidth, flops_rate = _memcpy_bytes_per_s(), _matmul_flops_per_s()
  out = {"machine": {"memcpy_GBps": bandwidth / 1e9, "matmul_GFLOPs": flops_rate / 1e9}}
  rng = np.random.default_rng(0)
  mesh = make_mesh(jax.devices()[:1], {})
  for preset in presets:
    cfg = get_preset(preset)
    model = Model(cfg)
    engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0)
    engine.update_weights(model.init(0), 0)
    prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(rows)]
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)] * rows
    step_s = decode_step_seconds(engine, prompts, sampling)
    floor_s = _matmul_only_step_seconds(cfg, rows)
    roof_s = _decode_roofline_s(cfg, rows, prompt_len + new_tokens / 2, bandwidth, flops_rate)
    out[preset] = {
      "decode_step_ms": step_s * 1e3,
      "matmul_only_ms": floor_s * 1e3,
      "roofline_ms": roof_s * 1e3,
      "roofline_fraction": roof_s / step_s,
      "matmul_only_roofline_fraction": roof_s / floor_s,
      "matmul_only_GFLOPs": 2 * cfg.num_params() * rows / floor_s / 1e9,
    }
  return out


def bench_rollout(
  presets=("micro", "bench-tiny", "bench-small"),
  num_prompts: int = 64,
  responses: int = 4,
  median: int = 64,
  cap: int = 512,
  max_running: int = 64,
  prompt_len: int = 32,
  roofline_seqs: int = 16,
  dtype: str | None = None,
  one_step_per_call: bool = True,
  repeats: int | None = None,
) -> dict:
  """Generated tokens/s of the paged engine and the static-batch baseline, one device.

  Response lengths are forced (EOS ignored, max_new_tokens = target) so both engines do the
  same work: a long tail (lognormal, median `median`, capped at `cap`) and equal lengths.
  Each engine runs every workload once to compile, then `repeats` times timed, alternating
  with the other (default: 3 on CPU, whose rates drift, 1 on accelerators): the medians. The
  `micro` preset's device work is negligible: there the host's per-token overhead decides.
  Each row also gives the device-to-host waits per generated token (the device idle until
  the host answers) and the executables each engine compiled.
  `dtype` replaces the preset's compute and parameter dtypes; the decode step of
  `roofline_seqs` sequences is timed against its roofline (and, with `one_step_per_call`, with
  one token per device call); `hbm_roofline_fraction` is weights + KV bytes over the copy
  bandwidth measured in the same run, over that step's time.
  """
  devices = jax.devices()[:1]
  mesh = make_mesh(devices, {})
  rng = np.random.default_rng(0)
  rows = num_prompts * responses
  tail = np.clip(np.round(rng.lognormal(np.log(median), 1.0, rows)), 1, cap).astype(int)
  workloads = {"long_tail": tail, "equal_lengths": np.full(rows, median)}
  bandwidth, flops_rate = _memcpy_bytes_per_s(), _matmul_flops_per_s()
  # Context for the roofline fraction: the matmul rate at the decode step's row count.
  skinny_rate = _matmul_flops_per_s(m=roofline_seqs, n=2048, k=512)
  out = {
    "machine": {
      "memcpy_GBps": bandwidth / 1e9,
      "matmul_GFLOPs": flops_rate / 1e9,
      f"matmul_{roofline_seqs}x512x2048_GFLOPs": skinny_rate / 1e9,
    }
  }
  for preset in presets:
    cfg = get_preset(preset, **({"dtype": dtype, "param_dtype": dtype} if dtype else {}))
    model = Model(cfg)
    params = model.init(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(num_prompts)]
    prompts = [p for p in prompts for _ in range(responses)]
    page_size = 16
    pages = max_running * -(-(prompt_len + cap) // page_size)
    slot_bytes = kv_bytes_per_token(cfg)
    paged = PagedEngine(
      model,
      mesh,
      ROLLOUT_RULES,
      eos_id=2,
      pad_id=0,
      config=PagedConfig(
        page_size=page_size,
        num_pages=pages,
        max_running=max_running,
        prefill_chunk=128,
        # As the RL job's auto setting: shapes sized for the longest sequence on accelerators
        # (one program per row count), bucketed on CPU.
        max_tokens=0 if jax.default_backend() == "cpu" else prompt_len + cap,
      ),
    )
    static = StaticEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, max_batch=max_running)
    row, engines = {}, {"paged": paged, "static": static}
    for engine in engines.values():
      engine.update_weights(params, 0)
    for workload, lengths in workloads.items():
      sampling = [
        SamplingParams(temperature=1.0, max_new_tokens=int(n), ignore_eos=True) for n in lengths
      ]
      for engine in engines.values():
        timed_generate(engine, prompts, sampling)  # compile every shape once
      rates = {name: [] for name in engines}
      for _ in range(repeats or (3 if jax.default_backend() == "cpu" else 1)):
        for name, engine in engines.items():  # alternated: the machine's drift hits both
          waits = engine.num_host_waits
          seconds, tokens = timed_generate(engine, prompts, sampling)
          assert tokens == int(lengths.sum()), (name, workload, tokens)
          rates[name].append(tokens / seconds)
          row[f"{name}_{workload}_host_syncs_per_token"] = (engine.num_host_waits - waits) / tokens
      row.update({f"{n}_{workload}_tokens_per_s": float(np.median(r)) for n, r in rates.items()})
    row.update({f"{name}_compiled_shapes": e.compiled_shapes() for name, e in engines.items()})
    # Roofline of one decode step of `roofline_seqs` equal-length sequences, at their mean
    # context over the timed steps.
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=median, ignore_eos=True)] * (
      roofline_seqs
    )
    step_s = decode_step_seconds(paged, prompts[:roofline_seqs], sampling)
    if one_step_per_call:
      single = PagedEngine(
        model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=PagedConfig(decode_steps=1)
      )
      single.update_weights(params, 0)
      single_step_s = decode_step_seconds(single, prompts[:roofline_seqs], sampling)
      row[f"decode_step_ms_{roofline_seqs}_seqs_one_step_per_call"] = single_step_s * 1e3
    context = prompt_len + median / 2
    roofline_s = _decode_roofline_s(cfg, roofline_seqs, context, bandwidth, flops_rate)
    hbm_roofline_s = _decode_hbm_s(cfg, roofline_seqs, context, bandwidth)
    row.update(
      {
        "paged_tokens_per_s": row["paged_long_tail_tokens_per_s"],
        "static_tokens_per_s": row["static_long_tail_tokens_per_s"],
        "speedup_long_tail": row["paged_long_tail_tokens_per_s"]
        / row["static_long_tail_tokens_per_s"],
        "speedup_equal_lengths": row["paged_equal_lengths_tokens_per_s"]
        / row["static_equal_lengths_tokens_per_s"],
        "dtype": cfg.dtype,
        "max_running": max_running,
        f"decode_step_ms_{roofline_seqs}_seqs": step_s * 1e3,
        "roofline_step_ms": roofline_s * 1e3,
        "roofline_fraction": roofline_s / step_s,
        "hbm_roofline_step_ms": hbm_roofline_s * 1e3,
        "hbm_roofline_fraction": hbm_roofline_s / step_s,
        "preemptions": paged.num_preemptions,
        # KV memory each engine holds: its page pools, and the static engine's biggest cache
        # (max_running rows x the power-of-two buckets of prompt and response slots).
        "paged_kv_cache_MB": paged.kv_pool_bytes / 2**20,
        "static_kv_cache_MB": max_running * (bucket(prompt_len) + bucket(cap)) * slot_bytes / 2**20,
      }
    )
    out[preset] = row
  out["machine"]["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  return out


# (name, sequences, query heads, kv heads, head dim, page size, context): decode shapes of one
# layer. "ragged" contexts are lognormal around the given median, capped at 8x it.
ATTENTION_CASES = (
  ("qwen3-8b_64x2k", 64, 32, 8, 128, 16, 2048),
  ("qwen3-8b_256x1k", 256, 32, 8, 128, 16, 1024),
  ("qwen3-8b_16x8k", 16, 32, 8, 128, 16, 8192),
  ("qwen3-8b_128xragged512", 128, 32, 8, 128, 16, -512),
  ("qwen3-8b_64x2k_page64", 64, 32, 8, 128, 64, 2048),
  ("qwen3-0.6b_128x2k", 128, 16, 8, 128, 16, 2048),
  ("qwen3-32b_64x4k", 64, 64, 8, 128, 32, 4096),
  # Short contexts: the decode profile's (32-token prompts, 64 new tokens), where the kernel
  # took 18 us a layer for 17 MB of keys and values, latency-bound.
  ("qwen3-0.6b_64x96", 64, 16, 8, 128, 16, 96),
  ("qwen3-0.6b_256x96", 256, 16, 8, 128, 16, 96),
  # Gemma 3 1B's local layers: 4k contexts of which a 512-position window is read (an eighth).
  ("gemma3-1b_64x4k_window512", 64, 4, 1, 256, 16, 4096, 512),
)


def bench_paged_attention(cases=ATTENTION_CASES, dtypes=("bfloat16", "float32")) -> dict:
  """Paged decode attention, one device: this backend's kernel against the jnp reference.

  Pages are a random permutation of the pool (a fragmented cache); a case with an eighth
  entry attends with that sliding window (its bytes: the pages the window overlaps). Reports each
  implementation's time, the KV bytes it must read per second, that rate as a fraction of the
  in-place copy rate (read + write) measured in the same run, and the kernel's largest
  difference from the reference. Rows are named by case, with "/float32" for a float32 cache;
  there the GPU kernel also runs at precision="highest" (exact IEEE products) beside its
  default (3xTF32 dots, or exact CUDA-core sums for small GQA groups). On a backend without a
  kernel (CPU) only the reference runs.
  """
  device = jax.devices()[0]
  kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(device.platform)
  bandwidth = _memcpy_bytes_per_s(1024 if kernel else 256)
  out = {"machine": {"platform": device.platform, "kind": device.device_kind}}
  out["machine"]["memcpy_GBps"] = bandwidth / 1e9
  rng = np.random.default_rng(0)
  for dtype, (name, n, h, k, d, s, context, *window) in itertools.product(dtypes, cases):
    window = window[0] if window else None
    dt = jnp.dtype(dtype)
    if context > 0:
      lengths = np.full(n, context, np.int32)
    else:
      median = -context
      lengths = np.clip(np.round(rng.lognormal(np.log(median), 1.0, n)), 1, 8 * median)
      lengths = lengths.astype(np.int32)
    m = -(-int(lengths.max()) // s)
    p = n * m
    page_indices = rng.permutation(p).reshape(n, m).astype(np.int32)
    args = (
      jax.device_put(rng.standard_normal((n, h, d)).astype(np.float32).astype(dt), device),
      jax.device_put(rng.standard_normal((k, p, s, d), np.float32).astype(dt), device),
      jax.device_put(rng.standard_normal((k, p, s, d), np.float32).astype(dt), device),
      jax.device_put(lengths, device),
      jax.device_put(page_indices, device),
    )
    # Keys and values of the used pages (with a window, those it overlaps), the bytes a decode
    # step cannot avoid reading.
    first_pages = 0 if window is None else np.maximum(lengths - window, 0) // s
    kv_bytes = 2 * k * d * dt.itemsize * s * int(np.sum(-(-lengths // s) - first_pages))
    row = {"tokens": int(lengths.sum()), "kv_MB": kv_bytes / 2**20, "window": window}
    # (row key, impl, precision)
    variants = [("reference", "reference", None)]
    if kernel:
      variants.append((kernel, kernel, None))
      if kernel == "pallas_gpu" and dt == jnp.float32:
        variants.append((f"{kernel}_highest", kernel, "highest"))
    results = {}
    for key, impl, precision in variants:
      fn = jax.jit(
        functools.partial(paged_attention, impl=impl, precision=precision, sliding_window=window)
      )
      results[key] = fn(*args)
      seconds = _best_seconds(lambda fn=fn, args=args: fn(*args))
      row[f"{key}_us"] = seconds * 1e6
      row[f"{key}_GBps"] = kv_bytes / seconds / 1e9
      row[f"{key}_bandwidth_fraction"] = kv_bytes / seconds / bandwidth
    for key, _, _ in variants[1:]:
      diff = jnp.abs(results[key].astype(jnp.float32) - results["reference"].astype(jnp.float32))
      suffix = "" if key == kernel else f"_{key}"
      row[f"max_abs_diff{suffix}"] = float(jnp.max(diff))
      row[f"speedup_vs_reference{suffix}"] = row["reference_us"] / row[f"{key}_us"]
    out[name if dt == jnp.bfloat16 else f"{name}/{dtype}"] = row
  return out


def _imported_when_asked(module: str, name: str):
  """`module.name`, imported only when run (Ray is an extra)."""
  return lambda **kwargs: getattr(importlib.import_module(module), name)(**kwargs)


bench_weight_transfer = _imported_when_asked("bench_transfer", "bench_weight_transfer")
bench_publish = _imported_when_asked("bench_publish", "bench_publish")
bench_chaos = _imported_when_asked("bench_chaos", "bench_chaos")
bench_moe_layer = _imported_when_asked("bench_moe", "bench_moe_layer")
bench_split_kernels = _imported_when_asked("bench_split", "bench_split_kernels")
bench_kv_shards = _imported_when_asked("bench_kv_shards", "bench_kv_shards")


BENCHMARKS = {
  "agent": bench_agent,
  "async": bench_async,
  "chaos": bench_chaos,
  "collectives": bench_collectives,
  "balance": bench_balance,
  "calibrate": bench_calibrate,
  "decode_floor": bench_decode_floor,
  "decode_profile": bench_decode_profile,
  "flash_attention": bench_flash_attention,
  "gmm": bench_gmm,
  "grpo_step": bench_grpo_step,
  "kernel_code": bench_kernel_code,
  "kernels": bench_kernels,
  "kv_shards": bench_kv_shards,
  "learner": bench_learner,
  "learner_rebuild": bench_learner_rebuild,
  "logprob_mismatch": bench_logprob_mismatch,
  "logprobs": bench_logprobs,
  "memory": bench_memory,
  "moe_layer": bench_moe_layer,
  "paged_attention": bench_paged_attention,
  "plan": bench_plan,
  "precompiled_rollout": bench_precompiled_rollout,
  "prefill_packing": bench_prefill_packing,
  "prefix_sharing": bench_prefix_sharing,
  "publish": bench_publish,
  "rollout": bench_rollout,
  "sampler": bench_sampler,
  "split_kernels": bench_split_kernels,
  "tgmm": bench_tgmm,
  "turn_kv": bench_turn_kv,
  "weight_transfer": bench_weight_transfer,
  "window_kv": bench_window_kv,
}


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("name", choices=sorted(BENCHMARKS))
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--presets", default=None, help="comma-separated model presets (rollout)")
  faults_help = "chaos: rollout kills, learner kills, job crashes (100,10,10)"
  parser.add_argument("--faults", default=None, help=faults_help)
  steps_help = "chaos, agent: RL steps of each run; turn_kv: timed runs"
  parser.add_argument("--steps", type=int, default=None, help=steps_help)
  rows_help = "rollout, decode_profile, window_kv: sequences at once (rollout: no 1-step engine)"
  parser.add_argument("--rows", type=int, default=None, help=rows_help)
  parser.add_argument("--dtype", default=None, help="rollout, decode_profile, kernels: dtype")
  trace_help = "decode_profile: keep the Perfetto trace in this folder"
  parser.add_argument("--trace-dir", default=None, help=trace_help)
  parser.add_argument("--prompt-len", type=int, default=None, help="decode_profile: prompt tokens")
  reference_help = "decode_profile: also run with these kernels' auto impl as the reference"
  parser.add_argument("--reference", default=None, help=reference_help)
  blocks_help = 'decode_profile: paged attention block sizes to try, "c,x,w,s;..." (e.g. "2,,2,1")'
  parser.add_argument("--attention-blocks", default=None, help=blocks_help)
  parser.add_argument("--profile", action="store_true", help="learner: also profile one update")
  chunks_help = "learner: LM-head positions at a time to compare, e.g. 128,1024"
  parser.add_argument("--logprob-chunks", default=None, help=chunks_help)
  remat_help = "learner: remat policies to compare (flash rows), e.g. full,save_attention"
  parser.add_argument("--remat-policies", default=None, help=remat_help)
  lengths_help = "learner on an accelerator: packed row lengths to run (4096, 16384)"
  parser.add_argument("--lengths", default=None, help=lengths_help)
  attentions_help = "learner on an accelerator: attentions to run (flash, cudnn, dense)"
  parser.add_argument("--attentions", default=None, help=attentions_help)
  flash_blocks_help = (
    "kernel_code: flash attention tilings to compile too, BlockSizes fields, e.g. "
    '"block_q_bwd=32,block_kv_bwd=64,num_warps=4;block_q=64"'
  )
  parser.add_argument("--flash-blocks", default=None, help=flash_blocks_help)
  target_help = "moe_layer, split_kernels, kv_shards: compile for this GPU (gpu_targets)"
  parser.add_argument("--target", default=None, help=target_help)
  args = parser.parse_args()
  kwargs = {"presets": tuple(args.presets.split(","))} if args.presets else {}
  if args.rows and args.name in ("decode_profile", "window_kv"):
    kwargs["rows"] = args.rows
  elif args.rows:
    kwargs.update(max_running=args.rows, roofline_seqs=args.rows, one_step_per_call=False)
  if args.dtype:
    kwargs["dtype"] = args.dtype
  if args.profile:
    kwargs["profile"] = True
  if args.logprob_chunks:
    kwargs["logprob_chunks"] = tuple(int(c) for c in args.logprob_chunks.split(","))
  if args.remat_policies:
    kwargs["remat_policies"] = tuple(args.remat_policies.split(","))
  if args.lengths or args.attentions:
    lengths = {int(n) for n in args.lengths.split(",")} if args.lengths else None
    attentions = set(args.attentions.split(",")) if args.attentions else None
    kwargs["settings"] = tuple(
      s
      for s in bench_learner_settings
      if (lengths is None or s[0] in lengths) and (attentions is None or s[1] in attentions)
    )
    if not kwargs["settings"]:
      raise SystemExit(
        f"--lengths {args.lengths} --attentions {args.attentions}: the learner bench runs "
        f"(length, attention) in {list(bench_learner_settings)}."
      )
  passed = (("prompt_len", "prompt_len"), ("trace_dir", "keep_trace_in"), ("target", "target"))
  kwargs.update({key: getattr(args, flag) for flag, key in passed if getattr(args, flag)})
  if args.reference:
    kwargs["reference_ops"] = tuple(args.reference.split(","))
  if args.attention_blocks:
    kwargs["attention_blocks"] = tuple(args.attention_blocks.split(";"))
  if args.flash_blocks:
    kwargs["flash_blocks"] = parse_flash_blocks(args.flash_blocks)
  if args.faults:
    kwargs["faults"] = tuple(int(n) for n in args.faults.split(","))
  if args.steps:
    kwargs["steps"] = args.steps
  result = BENCHMARKS[args.name](**kwargs)
  if args.json:
    print(json.dumps(result))
    return
  print(
    f"{args.name} on {platform.processor() or platform.machine()}, "
    f"{len(jax.devices())} {jax.default_backend()} devices, jax {jax.__version__}"
  )
  for key, row in result.items():
    if not isinstance(row, dict):
      print(f"  {key}: {row}")
      continue
    print(
      f"  {key}: "
      + ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in row.items()
        if not isinstance(v, list)
      )
    )


if __name__ == "__main__":
  sys.exit(main())
