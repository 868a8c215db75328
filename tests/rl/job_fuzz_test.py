"""Random job configurations: each runs to its end, or is refused with a message naming a key.

Each run draws, on top of `configs/grpo_tiny.py:test`, a model (the tiny dense one, one with
sliding-window layers, the tiny MoE one with either dispatch; rematerialised or not, layers
scanned or not, dense or flash attention, bf16 compute), a task (digit sorting, arithmetic,
countdown, math from the shipped sample, or the multi-turn number-guessing game), a placement
(colocated, disaggregated with random meshes, or planned), the loop (sync, async, auto; its
staleness, partial rollouts, dispatch, publication, workers), the rollout (batch, sampling,
dynamic sampling, rollout dtype, and every paged-engine setting: page size, page budget, rows,
prefill chunk and packing, window, prefix sharing, shape sizing, precompilation), the learner
(updates, micro-batches, packing, log-prob chunk, loss, optimizer, MoE routing replay and
placement), the warm-up, eval and checkpoints.

A run must then either end after its steps with finite metrics for every step, eval at the
start and the end, and a summary; or stop at once with a `ConfigError` whose message names a
config key (`config.<section>...`). With a checkpoint of its last step, it resumes for one more
step; where the loop is synchronous with one rollout worker (so that every run batches the
same requests), that step must be the one a run of all the steps trains (the same rewards and
lengths, the same loss and gradient norm to float32 rounding). Anything else (another
exception, a hang past the test's timeout, a missing step) fails.

A failing run names its seed: `JAXRL_JOB_SEED=<seed>` replays it.

With `-m slow`, four draws also run on the Ray backend (`ray_draw`: the learner and the
rollout workers as actors, each possibly a gang of two processes), with the same checks.
"""

import math
import os

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.metrics import read_metrics
from jaxrl.rl import job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "grpo_tiny.py")
MATH_SAMPLE = os.path.join(REPO, "jaxrl", "data", "samples", "math_sample.jsonl")
MESH_AXES = ("data", "fsdp", "tensor", "expert")
# `pretrained.path` of a draw that starts from a checkpoint: "<HF_CHECKPOINT><arch>:<tokenizer
# style>", written by `run_configuration` (`helpers.hf_checkpoints`: 2 KV heads, 512 ids).
HF_CHECKPOINT = "hf-checkpoint:"
HF_ARCHS = ("qwen3", "llama", "qwen3_moe", "gemma2", "mistral")


def _choice(rng, options):
  return options[int(rng.integers(len(options)))]


def _mesh(rng, devices: int, moe: bool, prefix: str, valid: bool) -> dict:
  """Random axis sizes whose product is `devices` (or one axis -1 for the rest); a valid
  draw's tensor axis divides the models' 2 KV heads."""
  axes = {axis: 1 for axis in MESH_AXES}
  left = devices
  for axis in rng.permutation(MESH_AXES if moe else MESH_AXES[:3]):
    most = 2 if valid and axis == "tensor" else 8
    size = _choice(rng, [d for d in (1, 2, 4, 8) if left % d == 0 and d <= most])
    axes[str(axis)] = size
    left //= size
  rest = [a for a in MESH_AXES if axes[a] == 1 and a != "tensor"] or ["data"]
  axes[_choice(rng, rest)] *= left
  if rng.random() < 0.3:  # one axis as "the rest"
    axes[_choice(rng, list(MESH_AXES))] = -1
  return {f"{prefix}.{axis}": size for axis, size in axes.items()}


def _model(rng) -> tuple[dict, bool]:
  """The model's overrides, and whether it is an MoE model."""
  kind = _choice(rng, ["dense", "dense", "window", "moe", "moe-grouped", "hf"])
  o = {"model.dtype": _choice(rng, ["float32", "float32", "bfloat16"])}
  moe = kind.startswith("moe")
  if kind == "hf":  # a tiny checkpoint transformers writes, with a BPE tokenizer of its own
    arch = _choice(rng, HF_ARCHS)
    style = _choice(rng, ["qwen3", "llama3"])
    o |= {"pretrained.path": f"{HF_CHECKPOINT}{arch}:{style}", "tokenizer": "pretrained"}
    o["pretrained.enable_thinking"] = bool(rng.random() < 0.5)
    moe = arch == "qwen3_moe"
    if moe:
      o["model.moe_dispatch"] = _choice(rng, ["dense", "grouped"])
  if kind == "window":
    o |= {
      "model.num_layers": 3,
      "model.sliding_window": int(rng.integers(2, 9)),
      "model.sliding_layers": (0, 2),
      "model.local_rope_theta": 100.0,
    }
  if kind.startswith("moe"):
    o |= {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_mlp_dim": 128}
    o["model.moe_dispatch"] = "grouped" if kind == "moe-grouped" else "dense"
  o["model.attention"] = _choice(rng, ["dense", "flash"])
  o["model.scan_layers"] = bool(rng.random() < 0.7)
  if rng.random() < 0.3:
    o |= {"model.remat": True, "model.remat_policy": _choice(rng, ["full", "save_attention"])}
  return o, moe


def _task(rng, valid: bool, pretrained: bool) -> dict:
  if pretrained:  # math problems through the checkpoint's tokenizer and chat template
    return {
      "task.name": "math",
      "task.path": MATH_SAMPLE,
      "model.max_seq_len": 512,
      "rollout.paged.num_pages": 512,
      "checkpoint.hf_every": _choice(rng, [0, 1, 2]),  # the policy in Hub layout
    }
  name = _choice(rng, ["digit_sort", "digit_sort", "arithmetic", "countdown", "math", "guess"])
  if name == "digit_sort":
    return {"task.name": name, "task.sort_length": int(rng.integers(2, 7))}
  if name == "arithmetic":
    return {
      "task.name": name,
      "task.num_digits": int(rng.integers(1, 3)),
      "task.operations": _choice(rng, ["+", "+-", "+-*"]),
    }
  if name == "countdown":
    return {"task.name": name, "task.countdown_numbers": 3, "model.max_seq_len": 128}
  if name == "math":  # competition problems, free text: byte-tokenized (long prompts)
    return {
      "tokenizer": "byte" if valid else "char",
      "model.vocab_size": 264,  # the byte tokenizer's 259 ids, rounded up to divide meshes
      "task.name": "math",
      "task.path": MATH_SAMPLE,
      "task.instruction": "",
      "model.max_seq_len": 512,
      "rollout.paged.num_pages": 512,
    }
  return {  # the multi-turn game: one request per model turn, turns' KV kept
    "task.name": "guess_number",
    "task.guess_max_low": 85,
    "task.guess_widths": (7, 15),
    "env.name": "guess_number",
    # 4 guesses find any number of the widest range (15 numbers) by bisection
    "env.kwargs": {"max_guesses": int(rng.integers(4 if valid else 2, 7)), "say_range": True},
    "env.limits.max_turns": int(rng.integers(2, 5)),
    "env.max_tokens": 96,
    "model.max_seq_len": 128,
    "rollout.sampling.max_new_tokens": 4,
  }


def _placement(rng, moe: bool, valid: bool) -> dict:
  mode = _choice(rng, ["colocated", "disaggregated", "planned"])
  o = {"placement.mode": mode}
  if mode == "planned":
    return o
  train = _choice(rng, [1, 2, 4] if mode == "disaggregated" else [1, 2, 4, 8])
  o["placement.train_devices"] = train
  o |= _mesh(rng, train, moe, "placement.train_mesh", valid)
  if mode == "disaggregated":
    rollout = _choice(rng, [d for d in (1, 2, 4) if d + train <= 8])
    o["placement.rollout_devices"] = rollout
    o |= _mesh(rng, rollout, moe, "placement.rollout_mesh", valid)
  return o


def _loop(rng, colocated: bool, data: int) -> dict:
  """`colocated`: async is not drawn (refused on one set of simulated devices); `data`: the
  rollout mesh's data axis (0: unknown), which the drawn workers split (when not 0)."""
  workers = [0, 0, 1, 2] if data == 0 or data % 2 == 0 else [0, 0, 1]
  return {
    "loop.mode": _choice(rng, ["sync", "auto"] if colocated else ["sync", "async", "auto"]),
    "loop.max_staleness": int(rng.integers(0, 3)),
    "loop.partial_rollouts": bool(rng.random() < 0.5),
    "loop.skew_aware_dispatch": bool(rng.random() < 0.5),
    "loop.publish_on_device": bool(rng.random() < 0.5),
    "loop.measured_rates": bool(rng.random() < 0.2),
    "loop.rollout_workers": _choice(rng, workers),
  }


def _rollout(rng) -> dict:
  prompts, group = int(rng.integers(2, 5)), int(rng.integers(2, 5))
  o = {
    "rollout.prompts_per_step": prompts,
    "rollout.group_size": group,
    "rollout.sampling.temperature": _choice(rng, [1.0, 1.0, 0.7, 0.0]),
    "rollout.sampling.max_new_tokens": int(rng.integers(2, 11)),
    "rollout.sampling.ignore_eos": bool(rng.random() < 0.2),
    "rollout.dynamic_sampling": bool(rng.random() < 0.2),
    "rollout.dynamic_sampling_rounds": int(rng.integers(1, 3)),
    "rollout.param_dtype": _choice(rng, ["", "", "bfloat16"]),
    "rollout.free_during_train": bool(rng.random() < 0.5),
  }
  if rng.random() < 0.2:
    o["rollout.sampling.top_p"] = _choice(rng, [0.9, 0.5])
  if rng.random() < 0.2:
    o["rollout.sampling.top_k"] = int(rng.integers(1, 8))
  page = _choice(rng, [2, 4, 8, 16])
  o |= {
    "rollout.paged.page_size": page,
    "rollout.paged.num_pages": _choice(rng, [512, 512, 64, 24]),
    "rollout.paged.max_running": _choice(rng, [1, 2, 3, 8, 64]),
    "rollout.paged.prefill_chunk": _choice(rng, [4, 8, 16, 128]),
    "rollout.paged.decode_steps": _choice(rng, [1, 2, 3, 8]),
    "rollout.paged.precompile": bool(rng.random() < 0.1),
    "rollout.paged.share_prefix": bool(rng.random() < 0.7),
    "rollout.paged.max_tokens": _choice(rng, [-1, 0, 0, 48]),
    "rollout.paged.pack_prefill": bool(rng.random() < 0.7),
    "rollout.paged.prefill_tokens": _choice(rng, [16, 64, 4096]),
    "rollout.paged.compile_ahead": bool(rng.random() < 0.5),
    "rollout.paged.keep_turn_kv": bool(rng.random() < 0.7),
    "rollout.paged.window_pages": _choice(rng, [-1, 0, 8, 40]),
  }
  return o


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _train(rng, batch: int, moe: bool, valid: bool, batch_shards: int, expert_axis: bool) -> dict:
  """`batch_shards`: the training mesh's data x fsdp (0: planned), which a valid draw's
  micro-batches are a multiple of."""
  updates = [u for u in _divisors(batch) if u <= 2]
  if valid and batch_shards:
    updates = [u for u in updates if (batch // u) % batch_shards == 0] or updates
  updates = _choice(rng, updates)
  micros = _divisors(batch // updates)
  if valid and batch_shards:
    micros = [m for m in micros if m % batch_shards == 0] or micros
  steps = int(rng.integers(2, 4))
  o = {
    "train.steps": steps,
    "train.advantage": _choice(rng, ["grpo", "drgrpo"]),
    "train.updates_per_step": updates,
    "train.micro_batch_size": _choice(rng, micros),
    "train.pack_length": _choice(rng, [-1, -1, 0, 12, 64]),
    "train.logprob_chunk": _choice(rng, [1, 8, 128]),
    "train.precompile": bool(rng.random() < 0.15),
    "train.compile_ahead": bool(rng.random() < 0.5),
    "train.loss.aggregation": _choice(rng, ["token-mean", "seq-mean-token-mean"]),
    "train.loss.ratio_level": _choice(rng, ["token", "sequence"]),
    "train.loss.proximal": _choice(rng, ["behaviour", "recompute"]),
    "train.loss.behaviour_correction": "none",
    "train.loss.behaviour_level": _choice(rng, ["token", "sequence"]),
    "train.loss.clip_high": _choice(rng, [0.2, 0.28]),
    "train.loss.kl_weight": _choice(rng, [0.0, 0.0, 0.05]),
    "train.optimizer.learning_rate": _choice(rng, [1e-4, 1e-3]),
    "train.optimizer.schedule": _choice(rng, ["constant", "cosine", "linear"]),
    "train.optimizer.total_steps": 100,
    "train.optimizer.warmup_steps": _choice(rng, [0, 2]),
    "train.optimizer.mu_dtype": _choice(rng, ["float32", "bfloat16"]),
    "train.optimizer.grad_accum_dtype": _choice(rng, ["float32", "bfloat16"]),
  }
  if o["train.loss.proximal"] == "recompute" or not valid:
    o["train.loss.behaviour_correction"] = _choice(rng, ["none", "truncate", "mask"])
  if moe:
    replay = bool(rng.random() < 0.6)
    balanced = ["least_loaded", "replicate_pack"] if replay and (expert_axis or not valid) else []
    o |= {
      "train.moe.routing_replay": replay,
      "train.moe.placement": _choice(rng, ["static", *balanced]),
      "train.moe.capacity_factor": _choice(rng, [0.0, 0.0, 1.5]),
      # XLA:CPU cannot run a ragged all-to-all: refused on an expert axis of CPU devices
      "train.moe.exchange": "all_to_all" if valid else "ragged_all_to_all",
    }
  return o


def draw(seed: int) -> dict:
  """The config overrides of run `seed` (on top of `grpo_tiny.py:test`)."""
  rng = np.random.default_rng(seed)
  # Most runs keep to the rules the config states; the rest draw without them (and are
  # mostly refused).
  valid = bool(rng.random() < 0.85)
  model, moe = _model(rng)
  o = {"seed": int(rng.integers(1000)), "compile_cache_dir": ""}
  o |= model | _placement(rng, moe, valid)
  colocated = o["placement.mode"] == "colocated"
  train_mesh, rollout_mesh = _mesh_sizes(o, "train"), _mesh_sizes(o, "rollout")
  batch_shards = train_mesh["data"] * train_mesh["fsdp"] if train_mesh else 0
  loop = _loop(rng, colocated and valid, rollout_mesh.get("data", 0) if valid else 0)
  if valid and not rollout_mesh:  # planned: the planner's device count may be odd
    loop["loop.rollout_workers"] = 0
  # The task's settings come last: they win over the rollout's (a multi-turn game's turns).
  o |= loop | _rollout(rng) | _task(rng, valid, "pretrained.path" in o)
  if (
    valid
    and batch_shards
    and o["rollout.prompts_per_step"] * o["rollout.group_size"] % batch_shards
  ):
    o["rollout.prompts_per_step"] = batch_shards  # micro-batches split over the batch axes
  batch = o["rollout.prompts_per_step"] * o["rollout.group_size"]
  o |= _train(rng, batch, moe, valid, batch_shards, train_mesh.get("expert", 1) > 1)
  if valid:
    _keep_to_the_rules(o)
  o |= {
    "warmup.steps": _choice(rng, [0, 0, 2]),
    "warmup.batch_size": _choice(rng, [4, 16]),
    "eval.every": _choice(rng, [0, 1, 2, 3]),
    "eval.num_prompts": _choice(rng, [2, 5, 8]),
    "eval.temperature": _choice(rng, [0.0, 1.0]),
    "checkpoint.every": _choice(rng, [0, 1, 2]),
  }
  return o


def ray_draw(seed: int) -> dict:
  """Draw `seed` on the Ray backend: the learner and each rollout worker an actor, or a gang of
  2 processes (a JAX world of their own), pinned to cores of their own or not. The Ray settings
  come from a generator of their own, so the seed's other settings are those of `draw`."""
  rng = np.random.default_rng(seed + 7777)
  return draw(seed) | {
    "loop.backend": "ray",
    "train.num_processes": _choice(rng, [1, 1, 2]),
    "rollout.num_processes": _choice(rng, [1, 1, 2]),
    "loop.ray_pin_cores": bool(rng.random() < 0.3),
  }


def _mesh_sizes(o: dict, stage: str) -> dict:
  """The axis sizes of `stage`'s mesh ("train" or "rollout") in draw `o`, -1 resolved; {} for
  a planned placement."""
  if o["placement.mode"] == "planned":
    return {}
  colocated = o["placement.mode"] == "colocated"
  devices = o["placement.train_devices" if colocated else f"placement.{stage}_devices"]
  axes = {axis: o.get(f"placement.{stage}_mesh.{axis}", 1) for axis in MESH_AXES}
  if colocated and stage == "rollout":  # the default rollout mesh: data takes every device
    axes["data"] = -1
  return {a: devices // -math.prod(axes.values()) if n == -1 else n for a, n in axes.items()}


def _keep_to_the_rules(o: dict) -> None:
  """Adjusts a valid draw to the rules that tie settings of different sections together."""
  if o.get("rollout.sampling.top_p", 1.0) < 1.0 or o.get("rollout.sampling.top_k", 0):
    # a truncated sampler is a behaviour policy apart from the learner's: correct for it
    o["train.loss.proximal"] = "recompute"
    if o["train.loss.behaviour_correction"] == "none":
      o["train.loss.behaviour_correction"] = "truncate"
  # One request of the model's longest fits the page budget (the job refuses less); a few
  # running at once may not, and are preempted.
  page, max_seq_len = o["rollout.paged.page_size"], o.get("model.max_seq_len", 64)
  o["rollout.paged.num_pages"] = max(o["rollout.paged.num_pages"], -(-max_seq_len // page))
  if o["rollout.paged.max_running"] > 8:
    # over a hundred programs to compile at 64 rows: minutes on 2 cores, for a run of seconds
    o["rollout.paged.precompile"] = False
  if o["rollout.paged.window_pages"] > 0 and "pretrained.path" in o:
    o["rollout.paged.window_pages"] = -1  # a checkpoint's window may be wider than drawn pools
  if o["rollout.paged.window_pages"] > 0 and "model.sliding_window" in o:
    # two rings of the window plus one call's tokens, and a page to spare each
    call = max(o["rollout.paged.decode_steps"], o["rollout.paged.prefill_chunk"])
    ring = -(-(o["model.sliding_window"] + call) // o["rollout.paged.page_size"]) + 1
    o["rollout.paged.window_pages"] = max(o["rollout.paged.window_pages"], 2 * ring)


def _check_finished(workdir: str, cfg, summary: dict) -> None:
  steps, eval_every = cfg.train.steps, cfg.eval.every
  assert summary["steps"] == steps
  records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == list(range(1, steps + 1))
  for r in train:
    for key in ("loss", "grad_norm", "entropy", "reward_mean", "response_length"):
      assert math.isfinite(r[key]), (r["step"], key, r[key])
  evals = [r["step"] for r in records if r["kind"] == "eval"]
  if eval_every:
    assert evals[0] == 0 and evals[-1] == steps, evals
    assert all(math.isfinite(r["eval_reward"]) for r in records if r["kind"] == "eval")
  else:
    assert evals == []
  if cfg.pretrained.path:  # the trained policy in Hub layout, for transformers and vLLM
    assert os.path.exists(os.path.join(workdir, "hf", "final", "config.json"))


def _write_checkpoint(overrides: dict, workdir: str) -> dict:
  """`overrides` with a drawn checkpoint written beside `workdir` and named by its path."""
  path = overrides.get("pretrained.path", "")
  if not path.startswith(HF_CHECKPOINT):
    return overrides
  from helpers import hf_checkpoints

  arch, style = path.removeprefix(HF_CHECKPOINT).split(":")
  directory = os.path.join(os.path.dirname(workdir), f"checkpoint_{arch}_{style}")
  if not os.path.exists(directory):
    hf_checkpoints.write_checkpoint(directory, arch, tokenizer=style)
  return {**overrides, "pretrained.path": directory}


def run_configuration(seed: int, workdir: str, ray: bool = False) -> str:
  """Runs configuration `seed` (`ray`: its Ray draw) in `workdir`; returns what it checked:
  "refused", "finished", "resumed" or "resumed as run straight"."""
  overrides = _write_checkpoint(ray_draw(seed) if ray else draw(seed), workdir)
  try:
    cfg = load_config(TINY, "test", overrides)
    summary = job.run(cfg, workdir, show_progress=False)
  except ConfigError as e:
    assert "config." in str(e), f"a ConfigError that names no key: {e}"
    return "refused"
  _check_finished(workdir, cfg, summary)
  if cfg.checkpoint.every and cfg.train.steps % cfg.checkpoint.every == 0:
    more = {**overrides, "train.steps": cfg.train.steps + 1}
    resumed = job.run(
      load_config(TINY, "test", more | {"resume": True}), workdir, show_progress=False
    )
    assert resumed["steps"] == cfg.train.steps + 1
    last = _train_records(workdir)[-1]
    assert last["step"] == cfg.train.steps + 1
    # On CPU every loop but "async" is sync; one worker batches the same requests each run.
    if cfg.loop.mode != "async" and cfg.loop.rollout_workers <= 1:
      straight = workdir + "_straight"
      job.run(load_config(TINY, "test", more), straight, show_progress=False)
      _assert_same_step(_train_records(straight)[-1], last)
      return "resumed as run straight"
    return "resumed"
  return "finished"


def _train_records(workdir: str) -> list[dict]:
  return [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["kind"] == "train"]


def _assert_same_step(straight: dict, resumed: dict) -> None:
  """A sync run resumed from its checkpoint trains the step it would have trained: the same
  prompts, responses and rewards, the same update to float32 rounding (a job resumed in a
  process of its own compiles its programs anew; here the runs share one process)."""
  assert straight["step"] == resumed["step"]
  for key in ("reward_mean", "response_length", "truncated_frac"):
    assert straight[key] == resumed[key], (key, straight[key], resumed[key])
  for key in ("loss", "grad_norm", "entropy", "kl", "clip_frac", "ratio_mean"):
    assert math.isclose(straight[key], resumed[key], rel_tol=1e-4, abs_tol=1e-6), (
      key, straight[key], resumed[key]
    )  # fmt: skip


def _run_seeded(seed: int, workdir: str, ray: bool = False) -> str:
  try:
    return run_configuration(seed, workdir, ray)
  except BaseException as e:
    if ray:
      e.add_note(f"Ray draw {seed} (overrides {ray_draw(seed)}).")
    else:
      e.add_note(f"JAXRL_JOB_SEED={seed} replays this run (overrides {draw(seed)}).")
    raise


def test_a_random_job_configuration_runs_or_is_refused(tmp_path):
  seed = int(os.environ.get("JAXRL_JOB_SEED") or np.random.default_rng().integers(1 << 31))
  _run_seeded(seed, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_job_configurations_run_or_are_refused(tmp_path, seed):
  _run_seeded(1000 + seed, str(tmp_path))


@pytest.fixture
def ray_after():
  """Ray for one test: `job.run` starts a local cluster; it is shut down after the test, so
  that the Ray tests of the same worker start their own."""
  ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")
  yield
  ray.shutdown()


# `slow`: 15-120 s a run on 2 cores (a local Ray cluster's start, actors compiling apart).
# Draw 21 (a learner of two processes recomputing the proximal policy) failed before the
# learner's log-probs came out whole in each process.
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("seed", [0, 5, 15, 21])
def test_random_ray_job_configurations_run_or_are_refused(tmp_path, ray_after, seed):
  _run_seeded(seed, str(tmp_path), ray=True)
