"""Benchmarks behind docs/BENCHMARKS.md.

  python launch/bench.py logprob_mismatch [--json]
  python launch/bench.py rollout [--json] [--presets bench-tiny,bench-small]

Each benchmark prints a table (or one JSON object with --json) and the machine it ran on.
"""

import argparse
import json
import platform
import resource
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxrl.model import Model, get_preset  # noqa: E402
from jaxrl.rl.experience import logprob_mismatch  # noqa: E402
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams, StaticEngine  # noqa: E402
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


def _memcpy_bytes_per_s(size_mb: int = 256) -> float:
  """Bytes moved per second by an on-device copy (read + write), the bandwidth roofline."""
  x = jax.device_put(np.ones(size_mb * 2**18, np.float32), jax.devices()[0])
  copy = jax.jit(lambda a: a + 0.0)
  copy(x).block_until_ready()
  start = time.perf_counter()
  for _ in range(10):
    y = copy(x)
  y.block_until_ready()
  return 2 * x.nbytes * 10 / (time.perf_counter() - start)


def _matmul_flops_per_s(n: int = 2048) -> float:
  a = jax.device_put(np.ones((n, n), np.float32), jax.devices()[0])
  mm = jax.jit(lambda x: x @ x)
  mm(a).block_until_ready()
  start = time.perf_counter()
  for _ in range(10):
    y = mm(a)
  y.block_until_ready()
  return 2 * n**3 * 10 / (time.perf_counter() - start)


def _timed_generate(engine, prompts, sampling) -> tuple[float, int]:
  start = time.perf_counter()
  outs = engine.generate(prompts, sampling, seed=0)
  return time.perf_counter() - start, sum(len(c.token_ids) for c in outs)


def bench_rollout(
  presets=("bench-tiny", "bench-small"),
  num_prompts: int = 64,
  responses: int = 4,
  median: int = 64,
  cap: int = 512,
  max_running: int = 64,
  prompt_len: int = 32,
  roofline_seqs: int = 16,
) -> dict:
  """Generated tokens/s of the paged engine and the static-batch baseline, one device.

  Response lengths are forced (EOS ignored, max_new_tokens = target) so both engines do the
  same work: a long tail (lognormal, median `median`, capped at `cap`) and equal lengths.
  Each engine runs every workload once to compile, then once timed.
  """
  devices = jax.devices()[:1]
  mesh = make_mesh(devices, {})
  rng = np.random.default_rng(0)
  rows = num_prompts * responses
  tail = np.clip(np.round(rng.lognormal(np.log(median), 1.0, rows)), 1, cap).astype(int)
  workloads = {"long_tail": tail, "equal_lengths": np.full(rows, median)}
  bandwidth, flops_rate = _memcpy_bytes_per_s(), _matmul_flops_per_s()
  out = {"machine": {"memcpy_GBps": bandwidth / 1e9, "matmul_GFLOPs": flops_rate / 1e9}}
  for preset in presets:
    cfg = get_preset(preset)
    model = Model(cfg)
    params = model.init(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(num_prompts)]
    prompts = [p for p in prompts for _ in range(responses)]
    page_size = 16
    pages = max_running * -(-(prompt_len + cap) // page_size)
    paged = PagedEngine(
      model,
      mesh,
      ROLLOUT_RULES,
      eos_id=2,
      pad_id=0,
      config=PagedConfig(
        page_size=page_size, num_pages=pages, max_running=max_running, prefill_chunk=128
      ),
    )
    static = StaticEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, max_batch=max_running)
    row = {}
    for name, engine in (("paged", paged), ("static", static)):
      engine.update_weights(params, 0)
      for workload, lengths in workloads.items():
        sampling = [
          SamplingParams(temperature=1.0, max_new_tokens=int(n), ignore_eos=True) for n in lengths
        ]
        _timed_generate(engine, prompts, sampling)  # compile every shape once
        seconds, tokens = _timed_generate(engine, prompts, sampling)
        assert tokens == int(lengths.sum()), (name, workload, tokens)
        row[f"{name}_{workload}_tokens_per_s"] = tokens / seconds
    # Roofline of one decode step of `roofline_seqs` sequences at the median context.
    context = prompt_len + median
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=median, ignore_eos=True)] * (
      roofline_seqs
    )
    few = prompts[:roofline_seqs]
    _timed_generate(paged, few, sampling)
    seconds, tokens = _timed_generate(paged, few, sampling)
    step_s = seconds / median
    weight_bytes = cfg.num_params() * np.dtype(cfg.param_dtype).itemsize
    kv_bytes = (
      roofline_seqs
      * context
      * cfg.num_layers
      * 2
      * cfg.num_kv_heads
      * cfg.head_dim
      * np.dtype(cfg.dtype).itemsize
    )
    step_flops = 2 * cfg.num_params() * roofline_seqs
    roofline_s = max((weight_bytes + kv_bytes) / bandwidth, step_flops / flops_rate)
    row.update(
      {
        "paged_tokens_per_s": row["paged_long_tail_tokens_per_s"],
        "static_tokens_per_s": row["static_long_tail_tokens_per_s"],
        "speedup_long_tail": row["paged_long_tail_tokens_per_s"]
        / row["static_long_tail_tokens_per_s"],
        "speedup_equal_lengths": row["paged_equal_lengths_tokens_per_s"]
        / row["static_equal_lengths_tokens_per_s"],
        f"decode_step_ms_{roofline_seqs}_seqs": step_s * 1e3,
        "roofline_step_ms": roofline_s * 1e3,
        "roofline_fraction": roofline_s / step_s,
        "preemptions": paged.num_preemptions,
      }
    )
    out[preset] = row
  out["machine"]["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  return out


BENCHMARKS = {"logprob_mismatch": bench_logprob_mismatch, "rollout": bench_rollout}


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("name", choices=sorted(BENCHMARKS))
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--presets", default=None, help="comma-separated model presets (rollout)")
  args = parser.parse_args()
  kwargs = {"presets": tuple(args.presets.split(","))} if args.presets else {}
  result = BENCHMARKS[args.name](**kwargs)
  if args.json:
    print(json.dumps(result))
    return
  print(
    f"{args.name} on {platform.processor() or platform.machine()}, "
    f"{len(jax.devices())} {jax.default_backend()} devices, jax {jax.__version__}"
  )
  for key, row in result.items():
    print(
      f"  {key}: "
      + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    )


if __name__ == "__main__":
  sys.exit(main())
