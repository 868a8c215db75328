"""`python launch/bench.py moe_layer`: one MoE layer on one device, the reference dispatch
(`model.moe_dispatch="dense"`: every expert on every token, outputs of unchosen experts zeroed)
against the grouped one (`"grouped"`: each token's k assignments sorted by expert, then
`jaxrl.kernels.gmm`), the layer as the model runs it (`jaxrl.model.moe.MoEMLP`: router,
biases, gated unit).

Timed on the default device, for each case: the forward of a prefill or learner batch
(`tokens`) and of decode steps (`rows`), and the forward and backward of the learner batch
(gradients of the input and of every weight, weights in float32 cast at use as the learner
keeps them). Time = median over rounds of the mean of back-to-back calls, compilation
excluded; beside it XLA's temporaries of each compiled program (MiB) and the largest
difference between the dispatches' outputs, relative to the largest output. Routed TFLOP/s
counts what the chosen experts need (2 x 3 matmuls of d x f per assignment forward, twice
that backward), whichever dispatch ran.

Cases: on a GPU or TPU the MoE layers of gpt-oss-20b (32 experts, top-4, d 2880, f 2880) and
Qwen3-30B-A3B (128, top-8, d 2048, f 768) in bf16, at 4k and 16k tokens and 64 and 256 decode
rows; on CPU two small layers (32 experts top-4 and 128 top-8) in fp32, 1,024 tokens and 64
rows, so that the command runs anywhere.

`--target h100` (no GPU needed: the CUDA plugin, as `launch/bench_kernels.py` says; or
`tpu-v5e` with libtpu, the layer cases only) compiles for that device instead: the GPU cases'
programs, reporting XLA's temporaries of each dispatch (what a layer's forward and backward
asks of the device's memory), and for a GPU the MoE set-ups of `RECIPES` whole
(`plan_moe_recipes`: the learner's update and the rollout engine's programs on one GPU or
eight): whether they compile for a GPU, and their memory plans.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from bench_gmm import _seconds_per_call
from flax import nnx

from jaxrl.kernels.common import target_platform
from jaxrl.model import ExpertParallel, MoEInputs, get_preset
from jaxrl.model.moe import MoEMLP
from jaxrl.sharding import make_mesh

DISPATCHES = ("dense", "grouped")
# (name, preset, overrides): the accelerator cases, then the CPU ones.
GPU_CASES = (("gpt-oss-20b", "gpt-oss-20b", {}), ("qwen3-30b-a3b", "qwen3-30b-a3b", {}))
_SMALL = dict(d_model=256, num_experts=32, experts_per_token=4, moe_mlp_dim=512)
CPU_CASES = (
  ("small-32x4", "tiny-moe", _SMALL),
  (
    "small-128x8",
    "tiny-moe",
    {**_SMALL, "num_experts": 128, "experts_per_token": 8, "moe_mlp_dim": 128},
  ),
)
GPU_TOKENS, GPU_ROWS = (4096, 16384), (64, 256)
CPU_TOKENS, CPU_ROWS = (1024,), (64,)


def layer_config(preset: str, overrides: dict, dtype: str, dispatch: str):
  """The model config of one case: its MoE layer computing in `dtype` on float32 weights."""
  return get_preset(preset, **overrides, dtype=dtype, param_dtype="float32", moe_dispatch=dispatch)


def layer_functions(cfg, mesh):
  """(forward, forward and backward) of one MoE layer of `cfg` as pure functions of (graph
  state, x): the forward returns the output, the other the gradients of a fixed projection of
  it with respect to the weights and x."""
  graph, _ = nnx.split(nnx.eval_shape(lambda: MoEMLP(cfg, rngs=nnx.Rngs(0))))
  moe = MoEInputs(ExpertParallel.for_mesh(cfg, mesh))

  def forward(state, x_btd):
    return nnx.merge(graph, state)(x_btd, moe)[0]

  def loss(state, x_btd):
    out = forward(state, x_btd).astype(jnp.float32)
    return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))

  return forward, jax.grad(loss, argnums=(0, 1))


def routed_tflop(cfg, tokens: int, backward: bool) -> float:
  """What the chosen experts compute: 3 matmuls of d x f per (token, k), twice as many back."""
  flops = 2 * 3 * tokens * cfg.experts_per_token * cfg.d_model * cfg.moe_mlp_dim
  return flops * (3 if backward else 1) / 1e12


def _relative_difference(a, b) -> float:
  a, b = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (a, b))
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _time_case(preset, overrides, dtype, tokens, rows, calls) -> dict:
  """Each program of one case under both dispatches: times, temporaries, and how far apart."""
  mesh = make_mesh(jax.devices()[:1], {})
  configs = {d: layer_config(preset, overrides, dtype, d) for d in DISPATCHES}
  state = nnx.split(MoEMLP(configs["dense"], rngs=nnx.Rngs(0)))[1]
  functions = {d: layer_functions(cfg, mesh) for d, cfg in configs.items()}
  rng = np.random.default_rng(0)
  out = {}
  for batch, backward in [(n, False) for n in (*rows, *tokens)] + [(n, True) for n in tokens]:
    kind = f"{'fwd_bwd' if backward else 'fwd'}_{batch}"
    x = jnp.asarray(rng.normal(size=(1, batch, configs["dense"].d_model)), dtype)
    results = {}
    for dispatch, (forward, grads) in functions.items():
      # The compiled program is what runs and is timed: compiled once, its plan read from it.
      compiled = jax.jit(grads if backward else forward).lower(state, x).compile()
      results[dispatch] = compiled(state, x)
      seconds = _seconds_per_call(compiled, state, x, calls=calls, rounds=5)
      out[f"{kind}_{dispatch}_ms"] = seconds * 1e3
      out[f"{kind}_{dispatch}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
      tflop = routed_tflop(configs[dispatch], batch, backward)
      out[f"{kind}_{dispatch}_routed_tflops"] = tflop / seconds
    out[f"{kind}_dense_over_grouped"] = out[f"{kind}_dense_ms"] / out[f"{kind}_grouped_ms"]
    pairs = zip(jax.tree.leaves(results["grouped"]), jax.tree.leaves(results["dense"]), strict=True)
    out[f"{kind}_max_rel_diff"] = max(_relative_difference(g, w) for g, w in pairs)
  return out


def bench_moe_layer(target: str | None = None, calls: int | None = None) -> dict:
  """The MoE layer's two dispatches timed on this device, or planned for `target`."""
  if target:
    from bench_kernels import TPU_TOPOLOGIES, _run_child

    out = {"target": target, "layer": _run_child({"target": target, "kind": "moe_layer"}, 1800.0)}
    if target not in TPU_TOPOLOGIES:  # the set-ups are GPU ones (8 GPUs of one host)
      recipes = {"target": target, "kind": "moe_recipes"}
      out["recipes"] = _run_child(recipes, 3600.0)
      out["recipes_unscanned"] = _run_child({**recipes, "scan_layers": False}, 3600.0)
    return out
  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  cases = CPU_CASES if on_cpu else GPU_CASES
  tokens, rows = (CPU_TOKENS, CPU_ROWS) if on_cpu else (GPU_TOKENS, GPU_ROWS)
  dtype = "float32" if on_cpu else "bfloat16"
  out = {"machine": {"platform": device.platform, "kind": device.device_kind}, "dtype": dtype}
  for name, preset, overrides in cases:
    cfg = layer_config(preset, overrides, dtype, "dense")
    out[name] = {
      "experts": cfg.num_experts,
      "top_k": cfg.experts_per_token,
      "d_model": cfg.d_model,
      "moe_mlp_dim": cfg.moe_mlp_dim,
      **_time_case(preset, overrides, dtype, tokens, rows, calls or (1 if on_cpu else 20)),
    }
  return out


def plan_moe_layer(spec: dict) -> dict:
  """In a fresh process (`bench_kernels._run_child`): XLA's temporaries (MiB) of each GPU
  case's programs, compiled for `spec["target"]` (a GPU, or a TPU topology's first chip)
  without its device, or the compiler's error (a TPU compile refuses a plan past its chip)."""
  from bench_kernels import TPU_TOPOLOGIES, _target_devices

  devices = _target_devices(spec["target"])
  platform = "tpu" if spec["target"] in TPU_TOPOLOGIES else "cuda"
  mesh = make_mesh(devices[:1], {})
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = {}
  for name, preset, overrides in GPU_CASES:
    for dispatch in DISPATCHES:
      cfg = layer_config(preset, overrides, "bfloat16", dispatch)
      forward, grads = layer_functions(cfg, mesh)
      state = nnx.split(nnx.eval_shape(lambda cfg=cfg: MoEMLP(cfg, rngs=nnx.Rngs(0))))[1]
      state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state
      )
      for tokens in GPU_TOKENS:
        x = jax.ShapeDtypeStruct((1, tokens, cfg.d_model), jnp.bfloat16, sharding=replicated)
        for kind, fn in (("fwd", forward), ("fwd_bwd", grads)):
          key = f"{name}_{kind}_{tokens}_{dispatch}"
          try:
            with target_platform(platform):
              compiled = jax.jit(fn).lower(state, x).compile()
            out[f"{key}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
          except Exception as e:  # noqa: BLE001  (a compiler error is this benchmark's finding)
            out[f"{key}_error"] = str(e).splitlines()[0][:500]
  return out


# (name, preset, mesh axes, GPUs, dispatch, routing replay): the MoE set-ups a user would run
# on GPUs. gpt-oss-20b on one GPU: its rollout engine (bf16 weights, 42 GB) fits an H100; its
# learner (fp32 master weights and Adam: about 250 GB) does not, and is planned to say so.
RECIPES = (
  ("gpt-oss-20b_1gpu_grouped", "gpt-oss-20b", {}, 1, "grouped", False),
  ("qwen3-30b-a3b_8gpu_expert8", "qwen3-30b-a3b", {"expert": 8}, 8, "dense", True),
)


def abstract_learner(train_cfg, mesh, length: int, rows: int = 1, replay: bool = False):
  """The recipes' learner for compiling without devices: one packed row of `length` positions
  a micro-batch row, `rows` rows, bf16 Adam first moment and gradient sums, TRAIN_RULES."""
  from jaxrl.model import Model
  from jaxrl.sharding import TRAIN_RULES
  from jaxrl.train import Learner, LossConfig, MoEConfig, OptimizerConfig

  return Learner(
    Model(train_cfg), mesh, TRAIN_RULES, loss=LossConfig(),
    optimizer=OptimizerConfig(mu_dtype="bfloat16", grad_accum_dtype="bfloat16"),
    updates_per_step=1, micro_batch_size=rows, temperature=1.0, params=None,
    pack_length=length, abstract=True, moe=MoEConfig(routing_replay=replay),
  )  # fmt: skip


def plan_moe_recipes(spec: dict) -> dict:
  """In a fresh process (`bench_kernels._run_child`): each of `RECIPES` compiled for
  `spec["target"]` GPUs without them: the learner's update (one packed row of
  `spec["length"]` positions a micro-batch, bf16 compute on fp32 master weights, remat, flash
  attention's Pallas kernel) and the paged rollout engine's programs (bf16 weights and KV, 64
  rows, `spec["max_tokens"]`-token sequences), or the compiler's error: whether these set-ups
  trace and compile for a GPU at all, and XLA's memory plan of each (GiB a GPU: the learner's
  micro-step and apply step apart, the engine's largest temporaries of its packed prefills and
  of its other programs). `spec["scan_layers"]` (default True) is the model's: a scan over
  the blocks stacks a copy of their weights inside the program (`ModelConfig.scan_layers`)."""
  import time

  from bench_kernels import _target_devices

  from jaxrl.compile_ahead import with_shardings
  from jaxrl.model import Model
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.rollout.precompile import engine_lowerings
  from jaxrl.rollout.sampling import NO_FILTER
  from jaxrl.sharding import ROLLOUT_RULES
  from jaxrl.train import update_plan

  length, max_tokens = spec.get("length", 2048), spec.get("max_tokens", 1024)
  only = spec.get("recipes")
  out = {}
  for name, preset, axes, gpus, dispatch, replay in RECIPES:
    if only and name not in only:
      continue
    devices = _target_devices(spec["target"], gpus)
    mesh = make_mesh(devices, axes)
    layers = {}
    if spec.get("num_layers"):  # fewer layers, for a quick check; sliding layers kept in range
      n = spec["num_layers"]
      kept = tuple(i for i in get_preset(preset).sliding_layers if i < n)
      layers = {"num_layers": n, "sliding_layers": kept}
    scan = spec.get("scan_layers", True)
    common = dict(moe_dispatch=dispatch, attention="flash", scan_layers=scan, **layers)
    train_cfg = get_preset(preset, dtype="bfloat16", param_dtype="float32", remat=True,
                           max_seq_len=length + 1, **common)  # fmt: skip
    rollout_cfg = get_preset(preset, dtype="bfloat16", param_dtype="bfloat16", **common)
    row = out[name] = {"gpus": gpus, "mesh": axes, "moe_dispatch": dispatch, "scan_layers": scan}
    with target_platform("cuda"):
      start = time.perf_counter()
      try:
        learner = abstract_learner(train_cfg, mesh, length, replay=replay)
        programs = update_plan.compiled_update(learner, 2, length)
        for kind, program in zip(("micro_step", "apply"), programs, strict=True):
          row[f"learner_{kind}"] = update_plan.memory_plan([program])
      except Exception as e:  # noqa: BLE001  (a compiler error is this benchmark's finding)
        row["learner_error"] = str(e).splitlines()[0][:500]
      row["learner_compile_s"] = round(time.perf_counter() - start, 1)
      start = time.perf_counter()
      try:
        model = Model(rollout_cfg)
        config = PagedConfig(page_size=16, num_pages=4096, max_running=64, prefill_chunk=512,
                             max_tokens=max_tokens, keep_turn_kv=False)  # fmt: skip
        engine = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=config)
        params = with_shardings(model.abstract_params(), engine.param_shardings)
        temps = {}
        for program, lower in engine_lowerings(engine, 1, NO_FILTER, params):
          kind = "packed_prefill" if program.jitted is engine._calls._prefill_packed else "other"
          temp = lower().compile().memory_analysis().temp_size_in_bytes / 2**30
          temps.setdefault(kind, []).append(temp)
        row["engine_programs"] = sum(map(len, temps.values()))
        for kind, values in temps.items():
          row[f"engine_{kind}_max_temp_gib"] = max(values)
      except Exception as e:  # noqa: BLE001
        row["engine_error"] = str(e).splitlines()[0][:500]
      row["engine_compile_s"] = round(time.perf_counter() - start, 1)
  return out
