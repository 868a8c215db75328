"""KV memory of sliding-window layers: rings of pages (`jaxrl.rollout.window_kv`) against one
pool that holds every position, on the paged engine.

python launch/bench.py window_kv [--json] [--presets gemma3-1b] [--rows 8]

Both engines get the same page budget (`num_pages`: every row's longest sequence) and the same
requests (random weights, sampled with the same seeds, no end token). Reported: the bytes of
each engine's KV pools, its tokens/s (second of two generates: the first compiles), and
whether the two produced the same tokens. On CPU the model is cut to one period of its
layer pattern and a 4,096-token vocabulary (named in the row), for time; on an accelerator it
runs as the preset is. `sized`: the pools the engine allocates for the whole preset at 64
rows of 1k to 32k tokens (from its shapes, nothing allocated), both ways.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model import Model, get_preset
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, make_mesh


def bench_window_kv(
  presets=("gemma3-1b",), rows: int = 8, prompt_len: int = 64, new_tokens: int = 704
) -> dict:
  mesh = make_mesh(jax.devices()[:1], {})
  rng = np.random.default_rng(0)
  cpu = jax.default_backend() == "cpu"
  out = {}
  for preset in presets:
    cfg = get_preset(preset)
    if cpu and cfg.sliding_layers:  # one period of the pattern: 5 local layers, 1 global
      period = next(i for i in range(cfg.num_layers) if i not in cfg.sliding_layers) + 1
      cfg = get_preset(
        preset, num_layers=period, vocab_size=4096,
        sliding_layers=tuple(i for i in cfg.sliding_layers if i < period),
      )  # fmt: skip
    name = preset if not cpu else f"{preset}_{cfg.num_layers}layers_vocab{cfg.vocab_size}"
    if not cfg.sliding_layers:
      raise SystemExit(f"window_kv: preset {preset} has no sliding-window layers.")
    model = Model(cfg)
    params = model.init(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(rows)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    pages = rows * -(-(prompt_len + new_tokens) // 16)
    row: dict = {"window": cfg.sliding_window, "sliding_layers": len(cfg.sliding_layers)}
    tokens = {}
    for label, window_pages in (("one_pool", 0), ("rings", -1)):
      config = PagedConfig(
        page_size=16, num_pages=pages, max_running=rows, window_pages=window_pages,
        max_tokens=0 if cpu else prompt_len + new_tokens,
      )  # fmt: skip
      engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
      engine.update_weights(params, 0)
      engine.generate(prompts, sampling, seed=0)  # compiles
      start = time.perf_counter()
      done = engine.generate(prompts, sampling, seed=0)
      seconds = time.perf_counter() - start
      tokens[label] = [c.token_ids.tolist() for c in done]
      row[f"{label}_kv_pool_MB"] = engine.kv_pool_bytes / 2**20
      row[f"{label}_tokens_per_s"] = sum(len(t) for t in tokens[label]) / seconds
      row[f"{label}_ring_pages"] = engine.ring_pages
    row["kv_pool_ratio"] = row["rings_kv_pool_MB"] / row["one_pool_kv_pool_MB"]
    row["tokens_per_s_ratio"] = row["rings_tokens_per_s"] / row["one_pool_tokens_per_s"]
    row["same_tokens"] = tokens["rings"] == tokens["one_pool"]
    out[name] = row
    out[f"{preset}_sized"] = _sized_pools(get_preset(preset), mesh)
  return out


def _sized_pools(cfg, mesh, rows: int = 64) -> dict:
  """MB of the KV pools of engines for `rows` sequences of 1k to 32k tokens, both ways."""
  model, out = Model(cfg), {}
  for length in (1024, 8192, 32768):
    pools = {}
    for label, window_pages in (("one_pool", 0), ("rings", -1)):
      config = PagedConfig(
        page_size=16, num_pages=rows * length // 16, max_running=rows,
        window_pages=window_pages, max_tokens=length,
      )  # fmt: skip
      engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
      kv = engine._calls.abstract_kv
      pools[label] = float(sum(2 * np.prod(k.shape) * jnp.dtype(k.dtype).itemsize for k, _ in kv))
    out[f"{rows}x{length}_one_pool_MB"] = pools["one_pool"] / 2**20
    out[f"{rows}x{length}_rings_MB"] = pools["rings"] / 2**20
    out[f"{rows}x{length}_ratio"] = pools["rings"] / pools["one_pool"]
  return out
