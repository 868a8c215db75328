"""`python launch/bench.py grpo_step`: a GRPO run's steps on a long-tail workload, and what
compiles after the first one (`precompiled_rollout`, `learner_rebuild`: below).

Each step generates `prompts x group` responses with the paged engine (response lengths forced
to a lognormal long tail: EOS ignored, `max_new_tokens` drawn per request), scores them with a
random reward, and trains one step on them with the learner: the two stages the RL loop runs,
with the loop's own batch builder and advantages; before each rollout the engine takes the
learner's weights as the job's workers do (cast to the rollout dtype "auto" gives:
bf16 on accelerators). A JAX monitoring listener counts every backend compilation and which
stage (`weights`, `rollout`, `train`) it happened in; those of other threads (the engine's
`compile_ahead`, compiling while the run goes on) as `background`, which nothing waited for.

Reported: compilations after the first step (target 0) per stage, in the run's own thread
(background ones apart: one that started in step 1 and ends after it is not a stall), the
learner's compiled
training shapes, median seconds per stage; `packed` runs as the job does by default (packed
learner, engine shapes sized for the longest sequence: `PagedConfig.max_tokens`), `padded` as it
did before (the padded learner compiles whenever a batch's length passes a new bucket, the
engine whenever a page table or prefill chunk does).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import threading
import time

import jax
import numpy as np

from jaxrl.auto_config import auto_settings, resolve_auto
from jaxrl.model import Model, ModelConfig, get_preset
from jaxrl.rl.experience import build_batch
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, OptimizerConfig, TrainBatch, group_advantages

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _CompileCounter:
  """Counts backend compilations, attributed to the stage set with `stage(name)`; those of
  other threads (`rollout.paged.compile_ahead`, `train.compile_ahead`: compiled while the
  run goes on) to "background", where nothing waits for them."""

  def __init__(self):
    self.current = "other"
    self.counts: dict[str, int] = {}
    self.functions: collections.Counter = collections.Counter()  # (stage, function name)
    self._thread = threading.get_ident()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, name: str, _secs: float, fun_name: str = "", **_kwargs) -> None:
    if name == _COMPILE_EVENT:
      stage = self.current if threading.get_ident() == self._thread else "background"
      self.counts[stage] = self.counts.get(stage, 0) + 1
      self.functions[stage, fun_name] += 1

  @contextlib.contextmanager
  def stage(self, name: str):
    previous, self.current = self.current, name
    try:
      yield
    finally:
      self.current = previous

  def snapshot(self) -> dict[str, int]:
    return dict(self.counts)


def _as_the_job_runs(cfg: ModelConfig) -> ModelConfig:
  """`cfg` with the compute dtype and attention the job's "auto" settings give it on this
  backend (`jaxrl.auto_config`): bf16 and flash or cuDNN attention on a GPU, float32 and dense
  attention on CPU (the presets' own settings)."""
  model = {"dtype": "auto", "attention": "auto", "d_model": cfg.d_model}
  resolved = resolve_auto({"model": model})["model"]
  return dataclasses.replace(cfg, dtype=resolved["dtype"], attention=resolved["attention"])


def _run(
  preset, steps, prompts, group, median, cap, prompt_len, pack_length, max_tokens, counter, seed
):
  cfg = _as_the_job_runs(get_preset(preset))
  model = Model(cfg)
  params = model.init(seed)
  devices = jax.devices()
  rollout_mesh = make_mesh(devices[:1], {})
  train_mesh = make_mesh(devices[:1], {})
  rows = prompts * group
  page_size = 16
  # The job's rollout weights: bf16 copies of fp32 master weights on accelerators.
  rollout_dtype = auto_settings()["rollout.param_dtype"] or cfg.param_dtype
  rollout_model = Model(dataclasses.replace(cfg, param_dtype=rollout_dtype))
  engine = PagedEngine(
    rollout_model, rollout_mesh, ROLLOUT_RULES, eos_id=2, pad_id=0,
    config=PagedConfig(
      page_size=page_size, num_pages=rows * -(-(prompt_len + cap) // page_size),
      max_running=rows, max_tokens=max_tokens,
    ),
  )  # fmt: skip
  learner = Learner(
    model, train_mesh, TRAIN_RULES, loss=LossConfig(), optimizer=OptimizerConfig(),
    updates_per_step=1, micro_batch_size=min(rows, 4), temperature=1.0, params=params,
    pack_length=pack_length,
  )  # fmt: skip
  rng = np.random.default_rng(seed)
  times = {"rollout": [], "train": []}
  after_first = None
  for step in range(steps):
    with counter.stage("weights"):
      engine.update_weights(learner.params, step)
    base = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(prompts)]
    lengths = np.clip(np.round(rng.lognormal(np.log(median), 1.0, rows)), 1, cap).astype(int)
    sampling = [
      SamplingParams(temperature=1.0, max_new_tokens=int(n), ignore_eos=True) for n in lengths
    ]
    start = time.perf_counter()
    with counter.stage("rollout"):
      completions = engine.generate([p for p in base for _ in range(group)], sampling, seed=step)
    times["rollout"].append(time.perf_counter() - start)
    rewards = rng.random(rows).astype(np.float32)
    batch = build_batch(completions, group_advantages(rewards, group), pad_id=0)
    start = time.perf_counter()
    with counter.stage("train"):
      jax.block_until_ready(learner.update(batch))
    times["train"].append(time.perf_counter() - start)
    if step == 0:
      after_first = counter.snapshot()
  final = counter.snapshot()
  stages = ("weights", "rollout", "train")
  after = {k: final.get(k, 0) - after_first.get(k, 0) for k in (*stages, "background")}
  return {
    # In the run's own thread: compilations it waited for.
    "compiles_after_first_step": sum(after[k] for k in stages),
    **{f"{stage}_compiles_after_first_step": after[stage] for stage in stages},
    "background_compiles_after_first_step": after["background"],
    # Packed: the micro-step's shapes; padded: the scanned update's (one per batch length).
    "train_shapes_compiled": sum(map(learner.compiled_shapes, ("micro_step", "update"))),
    "rollout_shapes_compiled": engine.compiled_shapes(),
    **{f"median_{stage}_s": statistics.median(t[1:]) for stage, t in times.items()},
    "longest_response": int(cap),
    "dtype": cfg.dtype,
    "attention": cfg.attention,
  }


def bench_grpo_step(
  presets=("bench-tiny",),
  steps: int = 20,
  prompts: int = 4,
  group: int = 4,
  median: int = 48,
  cap: int = 384,
  prompt_len: int = 32,
  seed: int = 0,
) -> dict:
  """`steps` GRPO steps of `prompts x group` long-tailed responses per preset, as the job
  runs them by default (packed learner, engine shapes sized for the longest sequence) and as
  it ran them before (padded learner, engine shapes bucketed; CPU only); one device for each
  stage."""
  counter = _CompileCounter()
  out = {}
  longest = prompt_len + cap  # what the job resolves -1 (auto) to, for both settings
  settings = [("packed", longest, longest), ("padded", 0, 0)]
  if jax.default_backend() != "cpu":
    # The padded learner compiles again at each new batch length (40-50 s each for
    # qwen3-0.6b on a GPU): the CPU rows show that contrast; accelerators run the default.
    settings = settings[:1]
  for preset in presets:
    for name, pack, max_tokens in settings:
      out[f"{preset}/{name}"] = _run(
        preset, steps, prompts, group, median, cap, prompt_len, pack, max_tokens, counter, seed
      )
  return out


def bench_learner_rebuild(
  presets=("bench-small",), rebuilds: int = 2, rows: int = 4, length: int = 64, seed: int = 0
) -> dict:
  """A learner built again in the same process, as the job does after a learner fault or on a
  resume: per build, the seconds to build it, its first update (compilation included) and a
  second one, and the backend compilations each build and its updates caused. One device,
  the dtype the job's "auto" gives this backend, padded updates of `rows` sequences of
  `length` tokens in micro-batches of 2."""
  counter = _CompileCounter()
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 250, (rows, length)).astype(np.int32)
  mask = np.zeros((rows, length - 1), np.float32)
  for i, end in enumerate(rng.integers(length // 2, length, rows)):
    mask[i, length // 4 : end] = 1  # a prompt of a quarter, a ragged response
  old = np.where(mask > 0, rng.normal(-3.0, 0.3, mask.shape), 0.0).astype(np.float32)
  batch = TrainBatch(tokens, mask, old, rng.normal(size=rows).astype(np.float32))
  out = {}
  for preset in presets:
    cfg = _as_the_job_runs(get_preset(preset, max_seq_len=length))
    for build in range(1 + rebuilds):
      before = sum(counter.snapshot().values())
      start = time.perf_counter()
      learner = Learner(
        Model(cfg), make_mesh(jax.devices()[:1], {"fsdp": 1}), TRAIN_RULES,
        loss=LossConfig(proximal="recompute"), optimizer=OptimizerConfig(learning_rate=1e-3),
        updates_per_step=1, micro_batch_size=2, temperature=1.0,
      )  # fmt: skip
      built = time.perf_counter()
      jax.block_until_ready(learner.update(batch))
      first = time.perf_counter()
      jax.block_until_ready(learner.update(batch))
      out[f"{preset}/{'first' if build == 0 else f'rebuilt {build}'}"] = {
        "build_s": built - start,
        "first_update_s": first - built,
        "second_update_s": time.perf_counter() - first,
        "compiles": sum(counter.snapshot().values()) - before,
      }
  return out


def bench_precompiled_rollout(
  presets=("bench-tiny",),
  generations: int = 8,
  max_running: int = 16,
  extra_stop_ids=(0, 2),
  seed: int = 0,
) -> dict:
  """A paged engine precompiled as `rollout.paged.precompile=True` does it (at its first
  weights, with `precompile`'s defaults), then `generations` generations of 1 to
  `max_running` requests (prompts of 1-19 tokens, 1-39 new tokens, EOS ignored), so that the
  batch's row count grows and shrinks between and within them; once per count of stop ids a
  request has besides the end token (`extra_stop_ids`: a chat tokenizer brings one or two).
  Reported: the programs precompiled and the seconds it took, and what compiled in the
  generations after (target: nothing), by function, and in how many generations. One device,
  the dtype the job's "auto" gives this backend, shapes sized for 64 tokens."""
  counter = _CompileCounter()
  out = {}
  for preset in presets:
    model = Model(_as_the_job_runs(get_preset(preset)))
    params = model.init(seed)
    for extra in extra_stop_ids:
      engine = PagedEngine(
        model, make_mesh(jax.devices()[:1], {}), ROLLOUT_RULES, eos_id=2, pad_id=0,
        config=PagedConfig(
          page_size=8, num_pages=8 * max_running, max_running=max_running, prefill_chunk=16,
          decode_steps=4, max_tokens=64, precompile=True, compile_ahead=False,
        ),
      )  # fmt: skip
      start = time.perf_counter()
      engine.update_weights(params, 0)  # precompiles
      precompile_s = time.perf_counter() - start
      precompiled = engine.compiled_shapes()  # the shapes it ran: every program it compiled
      rng = np.random.default_rng(seed)
      before, compiled_in = counter.functions.copy(), 0
      for g in range(generations):
        count = sum(counter.counts.values())
        rows = int(rng.integers(1, max_running + 1))
        prompts = [list(rng.integers(3, 60, int(rng.integers(1, 20)))) for _ in range(rows)]
        stops = list(range(5, 5 + extra))
        sampling = [
          SamplingParams(
            max_new_tokens=int(rng.integers(1, 40)), ignore_eos=True, stop_token_ids=stops
          )  # fmt: skip
          for _ in prompts
        ]
        with counter.stage("rollout"):
          engine.generate(prompts, sampling, seed=g)
        compiled_in += sum(counter.counts.values()) > count
      after = counter.functions - before
      out[f"{preset}/{extra}_extra_stop_ids"] = {
        "programs_precompiled": precompiled,
        "precompile_s": precompile_s,
        "compiles_after_precompile": sum(after.values()),
        "compiled_functions": {f"{stage}:{name}": n for (stage, name), n in after.items()},
        "generations_that_compiled": compiled_in,
      }
  return out
