"""`python launch/bench.py decode_profile`: where a decode step's device time goes, kernel by
kernel, from a profiler trace of the paged engine.

The engine decodes `rows` equal-length requests (`new_tokens` each) once to compile, then once
under `jax.profiler` (a Perfetto trace). The trace's device events (kernels on a GPU's streams;
a CPU has none) are grouped by kernel kind (XLA's numbering dropped, as in
`bench_kernels.py`) and divided by the decode steps taken: per step, each kind's launches and
microseconds, the device's busy time (the union of its kernels' intervals) and the wall time.
Busy time well below wall time: the device waits (for the host, or between kernels); busy time
spread thin over many kinds: a chain of small kernels (`bench.py kernels` counts them
without a GPU). The profiler may run XLA's command buffers as separate launches, so wall time
here is no figure of the engine's speed (`bench.py rollout` is).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

import jax
import numpy as np
from bench_kernels import kernel_kind  # launch/ is on sys.path

from jaxrl.kernels.common import auto_impls
from jaxrl.kernels.paged_attention import BlockSizes, default_block_sizes
from jaxrl.model import Model, get_preset
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, make_mesh


def device_kernels(trace: dict, module: str = "") -> list[tuple[str, float, float]]:
  """(name, start µs, duration µs) of every complete event of a device process in a Perfetto
  trace (`perfetto_trace.json.gz` of `jax.profiler`); host processes (`/host:...`) left out.
  Events that name their XLA module (`args.hlo_module`) are kept only if it contains `module`."""
  names = {
    e["pid"]: e["args"]["name"]
    for e in trace.get("traceEvents", [])
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  devices = {pid for pid, name in names.items() if name.startswith("/device:")}
  if not devices:  # a trace that names its devices otherwise: whatever is not the host
    devices = {pid for pid, name in names.items() if not name.startswith("/host:")}
  return [
    (e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
    for e in trace.get("traceEvents", [])
    if e.get("ph") == "X"
    and e.get("pid") in devices
    and module in e.get("args", {}).get("hlo_module", module)
  ]


def busy_microseconds(kernels: list[tuple[str, float, float]]) -> float:
  """The union of the kernels' intervals: time the device ran at least one."""
  busy, end = 0.0, float("-inf")
  for _, start, duration in sorted(kernels, key=lambda k: k[1]):
    stop = start + duration
    if stop > end:
      busy += stop - max(start, end)
      end = stop
  return busy


def summarize(kernels: list[tuple[str, float, float]], steps: int, top: int = 25) -> dict:
  """Per decode step: launches and device microseconds by kernel kind (the `top` costliest),
  and in all."""
  launches, micros = collections.Counter(), collections.Counter()
  for name, _, duration in kernels:
    kind = kernel_kind(name)
    launches[kind] += 1
    micros[kind] += duration
  return {
    "kernels_per_step": len(kernels) / steps,
    "busy_us_per_step": busy_microseconds(kernels) / steps,
    "kinds": [
      {
        "kind": kind,
        "launches_per_step": launches[kind] / steps,
        "us_per_step": us / steps,
        "us_per_launch": us / launches[kind],
      }
      for kind, us in micros.most_common(top)
    ],
  }


def run_profiled(fn, keep_as: str | None = None) -> tuple[float, dict]:
  """`fn()` (its results made ready) under `jax.profiler`: (its wall seconds under the
  profiler, the Perfetto trace as a dict), the trace also copied to `keep_as` when given."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    start = time.perf_counter()
    jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      trace = json.load(f)
    if keep_as:
      os.makedirs(os.path.dirname(keep_as) or ".", exist_ok=True)
      shutil.copy(path, keep_as)
  return seconds, trace


def decode_step_seconds(engine, prompts, sampling) -> float:
  """Mean time per decoded token of each row (one decode step) once the requests are admitted
  and prefilled; a window of several steps per engine step is divided by its tokens.

  The clock starts after the second engine step: the first dispatches the prefill and the
  first window without waiting for them, and the second reads that window back, which waits
  for both. Timed from the first step (before 2026-11-26), the prefill's device time counted
  as decoding: 64 rows after 1,024-token prompts took 10.7 ms "a step" on an H100 where the
  step's kernels ran 4.4 ms."""
  engine.generate(prompts, sampling, seed=0)  # compiles every shape the timed run meets
  for i, (p, sp) in enumerate(zip(prompts, sampling, strict=True)):
    engine.submit(p, sp, seed=i)
  done = engine.step()  # admission, prefill and the first window, dispatched
  done += engine.step()  # the second window dispatched, the first read back: prefill done
  first = sum(len(s.record.token_ids) for s in engine.running.values())
  first += sum(len(record.token_ids) for record in done)
  if not engine.running:
    raise ValueError(
      "decode_step_seconds needs requests that outlast two engine steps (windows of "
      f"decode_steps tokens); got max_new_tokens {[sp.max_new_tokens for sp in sampling][:4]}."
    )
  start = time.perf_counter()
  while engine.has_work:
    engine.step()
  seconds = time.perf_counter() - start
  total = sum(sp.max_new_tokens for sp in sampling)  # forced lengths: every row runs to its cap
  return seconds / ((total - first) / len(prompts))


def _profile_engine(cfg, rows, prompt_len, new_tokens, keep_trace_in, tag) -> dict:
  """One engine's decode steps: timed without the profiler, then once under it."""
  on_cpu = jax.default_backend() == "cpu"
  model = Model(cfg)
  engine = PagedEngine(
    model,
    make_mesh(jax.devices()[:1], {}),
    ROLLOUT_RULES,
    eos_id=2,
    pad_id=0,
    config=PagedConfig(
      num_pages=rows * -(-(prompt_len + new_tokens) // 16),
      max_running=rows,
      max_tokens=0 if on_cpu else prompt_len + new_tokens,
    ),
  )
  engine.update_weights(model.init(0), 0)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(rows)]
  sampling = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)] * rows
  # Compiles every shape the runs below meet, then times the decode steps without a profiler.
  step_s = decode_step_seconds(engine, prompts, sampling)
  keep_as = None
  if keep_trace_in:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"decode_{tag}_{rows}.json.gz")
    keep_as = os.path.join(keep_trace_in, name)
  seconds, trace = run_profiled(lambda: engine.generate(prompts, sampling, seed=1), keep_as)
  # Every row decodes new_tokens - 1 steps after the token its prefill samples.
  steps = new_tokens - 1
  kernels = device_kernels(trace, module="decode_impl")  # the decode windows, not prefill
  out = {
    "decode_step_ms": step_s * 1e3,
    "wall_ms_per_step_profiled": seconds * 1e3 / steps,
    "steps": steps,
    # What the trace held, for reading a first run on a new machine.
    "processes": sorted(
      e["args"]["name"] for e in trace.get("traceEvents", []) if e.get("name") == "process_name"
    ),
  }
  out.update(summarize(kernels, steps) if kernels else {"device_events": 0})
  return out


def parse_block_sizes(spec: str) -> BlockSizes:
  """ "c,x,w,s" (pages per compute block, splits, warps, stages; empty: derived) as paged
  attention `BlockSizes`, e.g. "2,,2,1"."""
  fields = spec.split(",")
  if len(fields) != 4:
    raise ValueError(f"Attention blocks {spec!r}: expected 4 comma-separated fields c,x,w,s.")
  try:
    return BlockSizes(*(int(f) if f.strip() else None for f in fields))
  except ValueError as e:
    raise ValueError(f"Attention blocks {spec!r}: {e}") from None


def bench_decode_profile(
  presets=("bench-small",),
  rows: int = 64,
  prompt_len: int = 32,
  new_tokens: int = 64,
  dtype: str | None = None,
  keep_trace_in: str | None = None,
  reference_ops: tuple[str, ...] = (),
  attention_blocks: tuple[str, ...] = (),
) -> dict:
  """The paged engine's decode steps of `rows` requests under the profiler, one device.

  Each preset's row has `decode_step_ms` (timed without the profiler, as `bench.py rollout`
  does) and the per-kernel profile. Variants, each its own engine in the same process with
  the same settings, for A/Bs inside the model: `reference_ops` (kernel names, e.g.
  `qk_rope_write`) runs once more with those kernels' "auto" resolved to their reference (row
  `<preset>/reference:<ops>`); each of `attention_blocks` ("c,x,w,s", `parse_block_sizes`)
  runs once with those paged attention block sizes (row `<preset>/blocks:<spec>`).
  `keep_trace_in`: also keep each run's Perfetto trace there (`decode_<row>_<rows>.json.gz`),
  for reading kernel by kernel (ui.perfetto.dev)."""
  on_cpu = jax.default_backend() == "cpu"
  dtype = dtype or ("float32" if on_cpu else "bfloat16")
  variants = [("", contextlib.nullcontext)]
  if reference_ops:
    overrides = dict.fromkeys(reference_ops, "reference")
    variants.append((f"/reference:{'+'.join(reference_ops)}", lambda: auto_impls(**overrides)))
  for spec in attention_blocks:
    blocks = parse_block_sizes(spec)
    variants.append((f"/blocks:{spec}", lambda blocks=blocks: default_block_sizes(blocks)))
  out = {"device": str(jax.devices()[0].device_kind), "rows": rows, "dtype": dtype}
  for preset in presets:
    cfg = get_preset(preset, dtype=dtype, param_dtype=dtype)
    args = (cfg, rows, prompt_len, new_tokens, keep_trace_in)
    for suffix, context in variants:
      with context():
        out[preset + suffix] = _profile_engine(*args, tag=preset + suffix)
  return out
