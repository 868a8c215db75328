"""`python launch/bench.py kernels`: the kernels of one decode step, as XLA compiles the paged
engine's decode window for a GPU, on a machine without one.

A decode step of a small model at a few dozen rows is a chain of some 400 small kernels, each
a few microseconds; their count, not the bytes they move, bounds the step (issue 16: 1.26 ms a
step at 16 rows against a 0.4 ms memory floor on an H200). This benchmark compiles the window
(`PagedCalls.decoder`, bf16, `PagedConfig.decode_steps` steps) ahead of time for an H100 or
H200 described by `benchmarks/gpu_targets/*.txtpb`, reads the thunk sequence XLA dumps (what
the GPU runtime will launch), and counts the launches of one step (one pass of the window's
loop body): per layer (the difference between 2-layer and 1-layer builds of the preset), the
rest (embedding, LM head, sampler), and how many run inside a CUDA graph (XLA's command
buffers).

XLA compiles without a device with its default tiles (no autotuning), so its choice between
GEMM kernels may differ from a device's; the kernels the model's ops make, and their number,
do not depend on it.

Needs the CUDA plugin, not a GPU (about 5 GB; keep it out of the test environment):

  pip install --target /opt/jax-cuda "jax-cuda12-plugin[with-cuda]==$JAX" "jax-cuda12-pjrt==$JAX"
  PYTHONPATH=/opt/jax-cuda python launch/bench.py kernels --json

where $JAX is the installed jax's version. Each compile runs in a process of its own (the plugin
and XLA's dump flag are set before jax starts).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ROOT / "benchmarks" / "gpu_targets"
PLUGIN_HELP = (
  'pip install --target DIR "jax-cuda12-plugin[with-cuda]==V" "jax-cuda12-pjrt==V" (V: this '
  "jax's version), then run with PYTHONPATH=DIR"
)
# Thunks that hold others (counted through their contents), and those that launch nothing.
_CONTAINERS = {"kCommandBuffer", "kWhile", "kConditional", "kSequential", "kDynamicSliceFusion"}
_THUNK = re.compile(r"^(?P<indent>\s*)\d+: (?P<kind>k\w+)\s+\[[^\]]*\]\s*(?P<name>\S*)")


def kernel_kind(name: str) -> str:
  """A kernel's name without XLA's numbering: `gemm_fusion_dot_310` -> `gemm_fusion_dot`."""
  return re.sub(r"(_\d+)+$", "", name) or name


def count_loop_body(thunk_sequence: str) -> dict:
  """Launches in the body of the first while loop of an XLA GPU thunk-sequence dump
  (`*.thunk_sequence_after_thunk_passes.txt`), by kernel kind, and how many of them are inside
  command buffers (CUDA graphs); the loop condition's launches apart."""
  lines = thunk_sequence.splitlines()
  start = next((i for i, line in enumerate(lines) if _THUNK.match(line) and "kWhile" in line), None)
  if start is None:
    raise ValueError("No kWhile thunk in the thunk sequence: is this a decode window's dump?")
  depth = len(_THUNK.match(lines[start])["indent"])
  section, kinds = None, collections.Counter()
  in_graph = condition = 0
  graph_depth: list[int] = []
  for line in lines[start + 1 :]:
    stripped = line.strip()
    if stripped in ("condition:", "body:"):
      section = stripped[:-1]
      continue
    match = _THUNK.match(line)
    if not match:
      continue
    indent = len(match["indent"])
    if indent <= depth:
      break  # back at the loop's own level: the loop ended
    while graph_depth and indent <= graph_depth[-1]:
      graph_depth.pop()
    kind = match["kind"]
    if kind == "kCommandBuffer":
      graph_depth.append(indent)
    if kind in _CONTAINERS:
      continue
    if section == "condition":
      condition += 1
      continue
    kinds[kernel_kind(match["name"]) if kind == "kCustomKernel" else kind] += 1
    in_graph += bool(graph_depth)
  total = sum(kinds.values())
  return {
    "launches": total,
    "in_cuda_graphs": in_graph,
    "outside_cuda_graphs": total - in_graph,
    "condition_launches": condition,
    "kinds": dict(kinds.most_common()),
  }


def _compile_window(spec: dict) -> dict:
  """In a fresh process (`spec`: preset, layers, rows, steps, target, dump): compiles the decode
  window for the target GPU and counts its loop body's launches."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies

  from jaxrl.kernels.common import target_platform
  from jaxrl.model import Model, get_preset
  from jaxrl.rollout.decode_loop import DecodeState, RowSampling
  from jaxrl.rollout.paged_calls import PagedCalls
  from jaxrl.rollout.paged_config import PagedConfig
  from jaxrl.rollout.sampling import NO_FILTER
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh, tree_shardings

  target = (TARGETS / f"{spec['target']}.txtpb").read_text()
  topology = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
  mesh = make_mesh(topology.devices, {})
  overrides = {"num_layers": spec["layers"]} if spec["layers"] else {}
  cfg = get_preset(spec["preset"], dtype="bfloat16", param_dtype="bfloat16", **overrides)
  model = Model(cfg)
  shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
  param_shardings = tree_shardings(model.logical_axes, mesh, ROLLOUT_RULES, shapes)
  rows, page_size, table = spec["rows"], 16, spec["table_pages"]
  config = PagedConfig(
    page_size=page_size, num_pages=rows * table, max_running=rows, decode_steps=spec["steps"]
  )
  calls = PagedCalls(model, mesh, ROLLOUT_RULES, param_shardings, config)
  calls.decoder(NO_FILTER)
  (params_s, kv_s, state_s, sampling_s, table_s), _ = calls._decode_shardings

  def arg(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  params = jax.tree.map(lambda a, s: arg(a.shape, a.dtype, s), model.abstract_params(), params_s)
  pool = (cfg.num_kv_heads, config.num_pages, page_size, cfg.head_dim)
  kv = [(arg(pool, jnp.bfloat16, a), arg(pool, jnp.bfloat16, b)) for a, b in kv_s]
  i32, b = jnp.int32, (rows,)
  state = DecodeState(*(arg(b, i32, s) for s in state_s[:4]), arg(b, jnp.bool_, state_s.live_b))
  sampling = RowSampling(
    arg(b, jnp.uint32, sampling_s.seeds_b),
    arg(b, jnp.float32, sampling_s.temperature_b),
    arg(b, i32, sampling_s.top_k_b),
    arg(b, jnp.float32, sampling_s.top_p_b),
    arg((rows, 4), i32, sampling_s.stop_ids_bs),
  )
  with target_platform("cuda"):
    lowered = calls.decoders[NO_FILTER].lower(
      params, kv, state, sampling, arg((rows, table), i32, table_s)
    )
  lowered.compile()
  dumps = sorted(
    pathlib.Path(spec["dump"]).glob("*_decode_impl*thunk_sequence_after_thunk_passes.txt")
  )
  if not dumps:
    raise RuntimeError(f"XLA wrote no thunk sequence of the decode window to {spec['dump']}.")
  return count_loop_body(dumps[-1].read_text())


def _run_child(spec: dict, timeout: float) -> dict:
  with tempfile.TemporaryDirectory() as dump:
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",  # no CUDA client: the plugin only compiles
      JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",  # its check needs a driver
      XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}",
    )
    spec = {**spec, "dump": dump}
    proc = subprocess.run(
      [sys.executable, __file__, "--child", json.dumps(spec)],
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
    )
  if proc.returncode != 0:
    tail = proc.stderr.strip().splitlines()[-3:]
    if any("topology not implemented for cuda" in line for line in tail):
      raise RuntimeError(f"The CUDA plugin is not installed: {PLUGIN_HELP}.")
    raise RuntimeError(f"Compiling {spec} failed: " + " | ".join(tail))
  return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_kernels(
  presets=("qwen3-0.6b",),
  rows: tuple[int, ...] = (16, 64),
  decode_steps: int = 8,
  target: str = "h100",
  table_pages: int = 64,
  timeout: float = 900.0,
) -> dict:
  """Launches per decode step of each preset at each row count, compiled for `target`.

  `table_pages`: page-table width (pages per row, 16 tokens each; 64: 1,024 tokens, about the
  width the RL job's auto shapes give a 544-token sequence). Per layer: the 2-layer build
  minus the 1-layer build; `other`: the 1-layer build minus one layer.
  """
  if not (TARGETS / f"{target}.txtpb").exists():
    known = sorted(p.stem for p in TARGETS.glob("*.txtpb"))
    raise ValueError(f"Unknown GPU target {target!r}; benchmarks/gpu_targets has {known}.")
  out: dict = {"target": target, "decode_steps": decode_steps, "table_pages": table_pages}
  for preset in presets:
    for n in rows:
      base = {"preset": preset, "rows": n, "steps": decode_steps, "target": target}
      base["table_pages"] = table_pages
      full = _run_child({**base, "layers": 0}, timeout)
      one = _run_child({**base, "layers": 1}, timeout)
      two = _run_child({**base, "layers": 2}, timeout)
      layer = collections.Counter(two["kinds"])
      layer.subtract(one["kinds"])
      out[f"{preset}_{n}_rows"] = {
        "launches_per_step": full["launches"],
        "in_cuda_graphs": full["in_cuda_graphs"],
        "outside_cuda_graphs": full["outside_cuda_graphs"],
        "loop_condition_launches": full["condition_launches"],
        "per_layer": two["launches"] - one["launches"],
        "other": 2 * one["launches"] - two["launches"],
        "per_layer_kinds": {k: v for k, v in layer.most_common() if v},
      }
  return out


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(_compile_window(json.loads(sys.argv[2]))))
  else:
    print(json.dumps(bench_kernels()))
