"""Prefill benchmarks: prefix sharing inside a group, and ragged prompts packed into rows.

python launch/bench.py prefix_sharing [--json] [--presets bench-tiny]
python launch/bench.py prefill_packing [--json] [--presets bench-tiny]
"""

import time

import jax
import numpy as np

from jaxrl.model import Model, get_preset
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, make_mesh


def timed_generate(engine, prompts, sampling) -> tuple[float, int]:
  """Seconds of one `generate` and the tokens it generated."""
  start = time.perf_counter()
  outs = engine.generate(prompts, sampling, seed=0)
  return time.perf_counter() - start, sum(len(c.token_ids) for c in outs)


def bench_prefix_sharing(
  presets=("bench-tiny",),
  prompt_len: int = 1024,
  group: int = 8,
  num_prompts: int = 8,
  new_tokens: int = 64,
) -> dict:
  """GRPO's shape of work: `num_prompts` prompts of `prompt_len` tokens, `group` sampled
  responses each, on the paged engine with and without `share_prefix` (prompt prefilled once,
  whole KV pages shared); wall time of the whole generate (prefill included), second run."""
  mesh = make_mesh(jax.devices()[:1], {})
  rng = np.random.default_rng(0)
  out = {}
  for preset in presets:
    cfg = get_preset(preset, max_seq_len=prompt_len + new_tokens)
    model = Model(cfg)
    params = model.init(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(num_prompts)]
    prompts = [p for p in prompts for _ in range(group)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    rows = len(prompts)
    row = {}
    for share in (False, True):
      config = PagedConfig(
        page_size=16, num_pages=rows * -(-(prompt_len + new_tokens) // 16), max_running=rows,
        prefill_chunk=512, share_prefix=share,
      )  # fmt: skip
      engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
      engine.update_weights(params, 0)
      timed_generate(engine, prompts, sampling)  # compile
      shared_before = engine.num_shared_prefill_tokens
      seconds, tokens = timed_generate(engine, prompts, sampling)
      name = "shared" if share else "unshared"
      row[f"{name}_seconds"] = seconds
      row[f"{name}_tokens_per_s"] = tokens / seconds
      row[f"{name}_prefilled_tokens"] = rows * (prompt_len - 1) - (
        engine.num_shared_prefill_tokens - shared_before
      )
    row["speedup"] = row["unshared_seconds"] / row["shared_seconds"]
    out[preset] = row
  return out


def bench_prefill_packing(
  presets=("bench-tiny",),
  num_prompts: int = 64,
  median_len: int = 120,
  chunk: int = 512,
  repeats: int = 3,
) -> dict:
  """Ragged prompts (lognormal lengths, median `median_len`, 8..`chunk`), one response of one
  token each: nearly all the work is prefill. The paged engine with `pack_prefill` off (one
  request per row, padded to the longest) and on (several to a row of `chunk` tokens); median
  wall time of `repeats` generates after a first that compiles, and the token positions the
  prefill calls computed."""
  mesh = make_mesh(jax.devices()[:1], {})
  rng = np.random.default_rng(0)
  lengths = np.clip(rng.lognormal(np.log(median_len), 0.8, num_prompts), 8, chunk).astype(int)
  out = {}
  for preset in presets:
    cfg = get_preset(preset, max_seq_len=chunk + 8)
    model = Model(cfg)
    params = model.init(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in lengths]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True)
    row = {"prompt_tokens": int(lengths.sum()), "longest_prompt": int(lengths.max())}
    for pack in (False, True):
      config = PagedConfig(
        page_size=16, num_pages=num_prompts * (chunk // 16 + 1), max_running=num_prompts,
        prefill_chunk=chunk, share_prefix=False, pack_prefill=pack,
      )  # fmt: skip
      engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
      engine.update_weights(params, 0)
      computed = []
      call = engine._calls.prefill_packed if pack else engine._calls.prefill
      counted = lambda *a, call=call, computed=computed: computed.append(a[2].size) or call(*a)  # noqa: E731
      if pack:
        engine._calls.prefill_packed = counted
      else:
        engine._calls.prefill = counted
      timed_generate(engine, prompts, sampling)  # compile
      computed.clear()
      seconds = [timed_generate(engine, prompts, sampling)[0] for _ in range(repeats)]
      name = "packed" if pack else "padded"
      row[f"{name}_seconds"] = float(np.median(seconds))
      row[f"{name}_positions_computed"] = sum(computed) // repeats
    row["speedup"] = row["padded_seconds"] / row["packed_seconds"]
    out[preset] = row
  return out
