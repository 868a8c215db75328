"""`python launch/bench.py kv_shards --json [--target h100]`: a paged engine over several
devices of `data`, whose KV pool splits over them (`KernelMesh.split_pages`; before, every
device held the whole pool and wrote every token into it).

- CPU (always): `bench-tiny` over 4 of the 8 simulated devices as `data` 4, 64 requests of
  32-128 prompt tokens and 256 new tokens each (ignore EOS; a GRPO step's rollouts), pages of
  16, `num_pages` 352 (one device's pool: 5,632 tokens, about 16 such requests; the 64 need
  about 1,350 pages), 64 rows. Reported: preemptions, prefill tokens computed (re-prefills of
  preempted requests included), decode windows, seconds, the KV pool bytes on one device and
  the tokens the engine can cache.
- `--target h100` (or another GPU target): Qwen3-0.6B's engine over 8 GPUs as `data` 8, as
  the HF recipe's sync rollout takes them (bf16, 8,192 pages of 16 on each GPU, 128 rows,
  2,048-token tables), compiled without the GPUs (the CUDA plugin, `launch/bench_kernels.py`):
  the collectives and temporaries of its decode step, its packed prefill and its chunked
  prefill (the most rows and the widest table of each), and the KV pool bytes on one GPU.
  `--target tpu-v5e`: the same over the topology's 4 chips, 4,096 pages each (libtpu; run
  with `JAX_PLATFORMS=cpu`, or the CPU workload's process holds libtpu's lock).

The module runs on the tree before this change too (no name of the change is needed): the
figures in docs/BENCHMARKS.md come from running it on both, one after the other.
"""

from __future__ import annotations

import time

import numpy as np


def _pool_bytes_per_device(kv) -> int:
  return sum(x.addressable_shards[0].data.nbytes for pair in kv for x in pair)


def run_workload(
  preset: str = "bench-tiny",
  data: int = 4,
  requests: int = 64,
  new_tokens: int = 256,
  num_pages: int = 352,
  seed: int = 0,
) -> dict:
  """The CPU workload of the module docstring on `data` simulated devices."""
  import jax

  from jaxrl.model import Model, get_preset
  from jaxrl.rollout import SamplingParams
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh

  model = Model(get_preset(preset))
  mesh = make_mesh(jax.devices()[:data], {"data": data})
  config = PagedConfig(page_size=16, num_pages=num_pages, max_running=64, prefill_chunk=128,
                       decode_steps=8, max_tokens=128 + new_tokens)  # fmt: skip
  engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
  engine.update_weights(model.init(seed), 0)
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, 1000, int(rng.integers(32, 129)))) for _ in range(requests)]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
  engine.generate(prompts[:4], sampling, seed=seed + 1)  # compiles the common shapes
  base = dict(
    preemptions=engine.num_preemptions, prefill=engine.num_prefill_tokens,
    windows=engine.num_windows,
  )  # fmt: skip
  start = time.perf_counter()
  done = engine.generate(prompts, sampling, seed=seed)
  seconds = time.perf_counter() - start
  shards = getattr(engine, "shards", 1)
  return {
    "devices": data,
    "seconds": round(seconds, 2),
    "preemptions": engine.num_preemptions - base["preemptions"],
    "prefill_tokens": engine.num_prefill_tokens - base["prefill"],
    "prompt_tokens": sum(len(p) for p in prompts),
    "decode_windows": engine.num_windows - base["windows"],
    "generated_tokens": sum(len(c.token_ids) for c in done),
    "kv_pool_mib_per_device": _pool_bytes_per_device(engine._kv) / 2**20,
    "cached_tokens_capacity": num_pages * shards * config.page_size,
  }


def plan_kv_shards(spec: dict) -> dict:
  """In a fresh process (`bench_kernels._run_child`): the compiled set-up of the module
  docstring, for GPUs or a TPU topology's chips."""
  from bench_kernels import TPU_TOPOLOGIES, _target_devices
  from bench_split import _measure

  from jaxrl.compile_ahead import with_shardings
  from jaxrl.kernels.common import target_platform
  from jaxrl.model import Model, get_preset
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.rollout.precompile import engine_lowerings
  from jaxrl.rollout.sampling import NO_FILTER
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh

  tpu = spec["target"] in TPU_TOPOLOGIES
  with target_platform("tpu" if tpu else "cuda"):
    devices = _target_devices(spec["target"], 8)[:8]  # a TPU target: its topology's chips
    mesh = make_mesh(devices, {"data": len(devices)})
    cfg = get_preset("qwen3-0.6b", dtype="bfloat16", param_dtype="bfloat16", attention="flash")
    model = Model(cfg)
    # A v5e chip has 16 GB: half the pages of an 80 GB GPU's.
    config = PagedConfig(page_size=16, num_pages=4096 if tpu else 8192, max_running=128,
                         prefill_chunk=512, max_tokens=2048)  # fmt: skip
    engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
    params = with_shardings(model.abstract_params(), engine.param_shardings)
    lowerings = engine_lowerings(engine, 1, NO_FILTER, params)
    calls = engine._calls
    out = {}
    for name, pick, shape_of in (
      ("decode_step", lambda p: p.on_device, lambda p: p.args[2].shape),  # rows, table pages
      ("packed_prefill", lambda p: p.jitted is calls._prefill_packed, lambda p: p.args[0].shape),
      ("chunked_prefill", lambda p: p.jitted is calls._prefill, lambda p: p.args[2].shape),
    ):
      shape, lower = max(((shape_of(p), lower) for p, lower in lowerings if pick(p)), key=_first)
      compile_program = lambda lower=lower: lower().compile()  # noqa: E731
      out[name] = {"rows": shape[0], "width": shape[1], **_measure(compile_program)}
    pool = calls.abstract_kv
    out["kv_pool_gib_per_device"] = sum(
      x.sharding.shard_shape(x.shape)[0] * np.prod(x.sharding.shard_shape(x.shape)[1:])
      * x.dtype.itemsize for pair in pool for x in pair
    ) / 2**30  # fmt: skip
    out["cached_tokens_capacity"] = (pool[0][0].shape[1]) * config.page_size
    return out


def _first(pair):
  return pair[0]


def bench_kv_shards(target: str | None = None) -> dict:
  """The CPU workload; with `target`, the GPU set-up compiled in a child process too."""
  out = {"cpu_data4": run_workload()}
  if target:
    from bench_kernels import _run_child

    out[target] = _run_child({"target": target, "kind": "kv_shards"}, 3600.0)
  return out
