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

`--target h100` (no GPU needed: the CUDA plugin, as `launch/bench_kernels.py` says) compiles
the GPU cases' learner programs for that GPU instead and reports XLA's temporaries of each
dispatch: what a layer's forward and backward asks of the card's memory.
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
      fn = jax.jit(grads if backward else forward)
      compiled = fn.lower(state, x).compile()
      results[dispatch] = fn(state, x)
      seconds = _seconds_per_call(fn, state, x, calls=calls, rounds=5)
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
    from bench_kernels import _run_child

    return {"target": target, **_run_child({"target": target, "kind": "moe_layer"}, 1800.0)}
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
  case's learner programs, compiled for `spec["target"]` without its device."""
  from bench_kernels import _target_devices

  devices = _target_devices(spec["target"])
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
            with target_platform("cuda"):
              compiled = jax.jit(fn).lower(state, x).compile()
            out[f"{key}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
          except Exception as e:  # noqa: BLE001  (a compiler error is this benchmark's finding)
            out[f"{key}_error"] = str(e).splitlines()[0][:500]
  return out
