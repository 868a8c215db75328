"""`python launch/bench.py kernels`: the paged engine's decode window as XLA compiles it for a
GPU or a TPU, on a machine with neither.

A decode step of a small model at a few dozen rows is a chain of some 400 small GPU kernels,
each a few microseconds (issue 16: 1.26 ms a step at 16 rows against a 0.4 ms memory floor on
an H200). This benchmark compiles the window (`PagedCalls.decoder`, bf16 or fp32,
`PagedConfig.decode_steps` steps) ahead of time for an H100 or H200 described by
`benchmarks/gpu_targets/*.txtpb`, reads the thunk sequence XLA dumps (what the GPU runtime
will launch), and counts the launches of one step (one pass of the window's loop body): per
layer (the difference between 2-layer and 1-layer builds of the preset), the rest (embedding,
LM head, sampler), and how many run inside a CUDA graph (XLA's command buffers). For GPU and
TPU targets (a TPU v5e, v6e or v4 topology) it also reports XLA's buffer plan: temporaries,
arguments, and how many whole KV pools the program copies (a layout change XLA inserted: on a
TPU, around a scatter into the pool's page and slot axes, every layer at every step, until
`jaxrl.model.cache.write_pages` wrote rows instead). And for every target, XLA's buffer plan of
the learner's update at the settings of `launch/bench.py learner` (`_plan_learner`, from an
abstract `Learner`): whether it fits one chip. `--child '{"target": T, "kind": "apply"}'` times
the compile of the learner's apply step alone for target T (`_compile_apply`); `"kind":
"update"` that of the update's programs, one after another or on threads as
`Learner.compile_ahead` compiles them (`_compile_update`); `"kind": "engine"` that of the
programs the HF recipe's rollout engine compiles ahead (`rollout.paged.compile_ahead`,
`_compile_engine`); `"kind": "moe_layer"` XLA's temporaries of an MoE layer's two dispatches
(`bench_moe.plan_moe_layer`, `python launch/bench.py moe_layer --target h100`).

Without a device XLA keeps its default GEMM tiles (no autotuning), so which GEMM kernels run
may differ on a card; the kernels the model's ops make, and their number, do not.

Needs the compilers, not the devices (keep them out of the test environment): for GPU targets
the CUDA plugin (about 5 GB), for TPU targets libtpu (about 0.7 GB):

  pip install --target /opt/jax-cuda "jax-cuda12-plugin[with-cuda]==$JAX" "jax-cuda12-pjrt==$JAX"
  pip install --target /opt/libtpu "libtpu==$LIBTPU"
  PYTHONPATH=/opt/jax-cuda:/opt/libtpu python launch/bench.py kernels --json

where $JAX is the installed jax's version and $LIBTPU the libtpu that `jax[tpu]` of that
version pins. Each compile runs in a process of its own (the plugins and XLA's dump flag are
set before jax starts).
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
TPU_HELP = "pip install --target DIR libtpu==V (V: the version jax[tpu] pins), then PYTHONPATH=DIR"
# TPU targets: a topology libtpu compiles for without a TPU (the program uses its first chip).
TPU_TOPOLOGIES = {"tpu-v5e": "v5e:2x2", "tpu-v6e": "v6e:2x2", "tpu-v4": "v4:2x2x1"}
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


def _target_devices(target: str, gpus: int = 1) -> list:
  """The devices of a target compiled for without them: a TPU topology, or `gpus` GPUs of one
  host described by its `benchmarks/gpu_targets` file."""
  from jax.experimental import topologies

  if target in TPU_TOPOLOGIES:
    return topologies.get_topology_desc(TPU_TOPOLOGIES[target], "tpu").devices
  config = (TARGETS / f"{target}.txtpb").read_text()
  return topologies.get_topology_desc(
    platform="cuda", target_config=config, topology=f"1x1x{gpus}"
  ).devices


def _compile_training_kernels(spec: dict) -> dict:
  """In a fresh process: the TPU kernels of the learner compiled for `spec["target"]` through
  Mosaic (the tests only lower them): flash attention forward and backward on Qwen3-0.6B heads
  at 4k and 16k positions, and the grouped matmul at Qwen3-30B-A3B's expert shapes. Each
  entry: XLA's temporaries in MiB, or the compiler's error."""
  import jax
  import jax.numpy as jnp

  from jaxrl.kernels import gmm
  from jaxrl.kernels.flash_attention import flash_attention

  mesh = jax.sharding.Mesh(_target_devices(spec["target"])[:1], ("x",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def arg(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

  def attention_loss(q, k, v, segments, positions):
    out = flash_attention(
      q, k, v, q_segment_ids=segments, kv_segment_ids=segments,
      q_positions=positions, kv_positions=positions, impl="pallas_tpu",
    )  # fmt: skip
    return jnp.sum(out.astype(jnp.float32))

  programs = {
    f"flash_attention_fwd_bwd_{n}": (
      jax.grad(attention_loss, argnums=(0, 1, 2)),
      (
        arg((1, n, 16, 128)),
        arg((1, n, 8, 128)),
        arg((1, n, 8, 128)),
        arg((1, n), jnp.int32),
        arg((1, n), jnp.int32),
      ),
    )  # fmt: skip
    for n in (4096, 16384)
  }
  for rows, groups in ((8192, 128), (16384, 8)):
    programs[f"gmm_{rows}x2048x768_{groups}_groups"] = (
      lambda lhs, rhs, sizes: gmm(lhs, rhs, sizes, impl="pallas_tpu"),
      (arg((rows, 2048)), arg((groups, 2048, 768)), arg((groups,), jnp.int32)),
    )
  out = {}
  for name, (fn, args) in programs.items():
    try:
      compiled = jax.jit(fn).lower(*args).compile()
      out[name] = {"temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20}
    except Exception as e:  # noqa: BLE001  (a compiler error is this benchmark's finding)
      out[name] = {"error": str(e).splitlines()[0][:500]}
  return out


# The remat policies the learner's plan compares on rows with flash attention (dense rows:
# "full" only, since the others keep flash attention's residuals).
PLAN_REMAT_POLICIES = ("full", "save_attention", "save_dots")


def flash_kernel_calls(hlo_text: str) -> dict[str, int]:
  """Custom calls of the flash attention kernels in a compiled program's HLO text, by kernel
  (`flash_attention_fwd_gpu`, `..._dq_tpu`, ...): how many times the program runs each."""
  calls = collections.Counter()
  for line in hlo_text.splitlines():
    if "custom-call(" not in line and "custom_call(" not in line:
      continue
    match = re.search(r"flash_attention_(fwd|dq|dkv)_(gpu|tpu)", line)
    if match:
      calls[match[0]] += 1
  return dict(sorted(calls.items()))


def _plan_learner(spec: dict) -> dict:
  """In a fresh process: XLA's buffer plan of the learner's update (`update_plan.memory_plan`)
  compiled for `spec["target"]` from an abstract learner (no device), at each setting of
  `launch/bench.py learner` (Qwen3-0.6B, one packed row of L positions per micro-batch, 2
  micro-batches per update), flash rows at each of `PLAN_REMAT_POLICIES`: what one chip of
  that kind needs for it, against what it has; the micro-step's own temporaries (the
  activations a remat policy keeps live there); and how many times the micro-step runs each
  flash attention kernel (`flash_kernel_calls`). Each entry: GiB of arguments (parameters,
  optimizer state, batch), outputs and temporaries, or the compiler's error (a TPU compile
  refuses a plan larger than the chip's memory)."""
  from bench_learner import SETTINGS, recipe_learner

  from jaxrl.kernels.common import target_platform
  from jaxrl.train import update_plan

  target = spec["target"]
  devices = _target_devices(target)
  out = {}
  for length, attention in SETTINGS:
    for policy in PLAN_REMAT_POLICIES if attention == "flash" else ("full",):
      _, learner = recipe_learner(
        "qwen3-0.6b", length, attention, devices, dtype="bfloat16", abstract=True,
        remat_policy=policy,
      )  # fmt: skip
      name = f"learner_{length}_{attention}" + ("" if policy == "full" else f"_{policy}")
      try:
        with target_platform("tpu" if target in TPU_TOPOLOGIES else "cuda"):
          programs = update_plan.compiled_update(learner, 2, length + 1)
        out[name] = update_plan.memory_plan(programs)
        micro = programs[0].memory_analysis().temp_size_in_bytes
        out[name]["micro_step_temporaries_gib"] = micro / 2**30
        if attention == "flash":
          out[name]["micro_step_kernel_calls"] = flash_kernel_calls(programs[0].as_text())
      except Exception as e:  # noqa: BLE001  (a compiler error is this benchmark's finding)
        out[name] = {"error": str(e).splitlines()[0][:500]}
  return out


def _abstract_recipe_learner(target: str, scan_layers: bool = True):
  """(abstract learner, platform to trace for) of the HF recipe's learner (Qwen3-0.6B, 4,096
  positions, flash attention keeping its output; its blocks scanned, or unrolled with
  `scan_layers` False) on `target`'s devices, or this CPU's."""
  import jax
  from bench_learner import recipe_learner

  devices = jax.devices() if target == "cpu" else _target_devices(target)
  _, learner = recipe_learner(
    "qwen3-0.6b", 4096, "flash", devices, dtype="bfloat16", abstract=True,
    remat_policy="save_attention", scan_layers=scan_layers,
  )  # fmt: skip
  return learner, "cpu" if target == "cpu" else "tpu" if target in TPU_TOPOLOGIES else "cuda"


def _compile_apply(spec: dict) -> dict:
  """In a fresh process: the HF recipe learner's apply step (`Learner._apply`: the finite
  check, clipping and AdamW over Qwen3-0.6B's fp32 master weights) lowered and compiled for
  `spec["target"]` (or "cpu") from an abstract learner: seconds of each, and its kernels
  (fusions). Run as `python launch/bench_kernels.py --child '{"target": "h100", "kind":
  "apply"}'` (with the CUDA plugin on PYTHONPATH for a GPU target)."""
  import time

  from jaxrl.kernels.common import target_platform
  from jaxrl.train import update_plan

  learner, platform = _abstract_recipe_learner(spec["target"], spec.get("scan_layers", True))
  sums = update_plan.abstract_sums(learner)
  with target_platform(platform):
    start = time.perf_counter()
    lowered = learner._apply.lower(learner.params, learner.opt_state, sums)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
  text = compiled.as_text()
  return {
    "lower_s": lower_s,
    "compile_s": compile_s,
    "fusions": len(re.findall(r" fusion\(", text)),
  }


def _cpu_seconds() -> float:
  """CPU seconds this process has used, its threads' included (user and system)."""
  import resource

  return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])


def _compile_update(spec: dict) -> dict:
  """In a fresh process: the HF recipe learner's update programs (the sums' zeros, the
  micro-step, the apply step: what its first update compiles) compiled for `spec["target"]`
  from an abstract learner, one after another (`"ahead": false`) or as `Learner.compile_ahead`
  compiles them, a thread each (`"ahead": true`): wall seconds, and the CPU seconds of the
  process. Run as `python launch/bench_kernels.py --child '{"target": "h100", "kind":
  "update", "ahead": true}'` (with the CUDA plugin on PYTHONPATH for a GPU target)."""
  import time

  from jaxrl.kernels.common import target_platform
  from jaxrl.train import update_plan

  learner, platform = _abstract_recipe_learner(spec["target"], spec.get("scan_layers", True))
  with target_platform(platform):
    start, cpu = time.perf_counter(), _cpu_seconds()
    if spec["ahead"]:
      update_plan.compile_ahead(learner, 1, []).result()
    else:
      for lower in update_plan.ahead_programs(learner, 1, []):
        lower().compile()
    return {"wall_s": time.perf_counter() - start, "cpu_s": _cpu_seconds() - cpu}


def _compile_engine(spec: dict) -> dict:
  """In a fresh process: the programs the HF recipe's rollout engine compiles ahead
  (`rollout.paged.compile_ahead`: Qwen3-0.6B in bf16, 128 rows, pages of 16, 512-token
  prefill chunks, shapes sized for `spec["max_tokens"]`-token sequences) compiled for
  `spec["target"]` from abstract weights and KV pool, one after another (`"ahead": false`:
  the seconds of each, by kind) or on the engine's threads (`"ahead": true`): wall and CPU
  seconds; `"scan_layers": false` unrolls the packed prefill's blocks. Run as `python
  launch/bench_kernels.py --child '{"target": "h100", "kind": "engine", "ahead": false}'`
  (with the CUDA plugin on PYTHONPATH)."""
  import time

  from jaxrl.compile_ahead import with_shardings
  from jaxrl.kernels.common import target_platform
  from jaxrl.model import Model, get_preset
  from jaxrl.rollout.paged import PagedConfig, PagedEngine
  from jaxrl.rollout.precompile import compile_engine_ahead, engine_lowerings
  from jaxrl.rollout.sampling import NO_FILTER
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh

  devices = _target_devices(spec["target"])[:1]
  # "auto" gives cuDNN on Hopper, whose packed rows need the card itself: the Pallas kernel here.
  attention = spec.get("attention", "flash")
  model = Model(get_preset("qwen3-0.6b", dtype="bfloat16", param_dtype="bfloat16",
                           attention=attention,
                           scan_layers=spec.get("scan_layers", True)))  # fmt: skip
  config = PagedConfig(
    page_size=16, num_pages=8192, max_running=128, prefill_chunk=512,
    max_tokens=spec.get("max_tokens", 700), keep_turn_kv=False,
  )  # fmt: skip
  engine = PagedEngine(model, make_mesh(devices, {}), ROLLOUT_RULES, eos_id=2, pad_id=0,
                       config=config)  # fmt: skip
  params = with_shardings(model.abstract_params(), engine.param_shardings)
  programs = engine_lowerings(engine, 1, NO_FILTER, params)
  calls = engine._calls
  kinds = {calls._prefill_packed: "packed_prefill", calls.copy_pages: "page_copy"}
  out: dict = {"programs": len(programs)}
  with target_platform("cuda"):
    start, cpu = time.perf_counter(), _cpu_seconds()
    if spec["ahead"]:
      for future in compile_engine_ahead(engine, 1, NO_FILTER, params):
        future.result()
    else:
      for program, lower in programs:
        kind = kinds.get(program.jitted, "decode_window")
        begun = time.perf_counter()
        lower().compile()
        out.setdefault(f"{kind}_s", []).append(round(time.perf_counter() - begun, 2))
    out |= {"wall_s": time.perf_counter() - start, "cpu_s": _cpu_seconds() - cpu}
  return out


def _compile_window(spec: dict) -> dict:
  """In a fresh process (`spec`: preset, layers, rows, steps, target, dump): compiles the decode
  window for the target GPU and counts its loop body's launches."""
  import jax
  import jax.numpy as jnp

  from jaxrl.kernels.common import target_platform
  from jaxrl.model import Model, get_preset
  from jaxrl.rollout.decode_loop import DecodeState, RowSampling
  from jaxrl.rollout.paged_calls import PagedCalls
  from jaxrl.rollout.paged_config import PagedConfig
  from jaxrl.rollout.sampling import NO_FILTER
  from jaxrl.sharding import ROLLOUT_RULES, make_mesh, tree_shardings

  tpu = spec["target"] in TPU_TOPOLOGIES
  mesh = make_mesh(_target_devices(spec["target"])[:1], {})
  overrides = {"num_layers": spec["layers"]} if spec["layers"] else {}
  dtype = spec.get("dtype", "bfloat16")
  cfg = get_preset(spec["preset"], dtype=dtype, param_dtype=dtype, **overrides)
  model = Model(cfg)
  shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
  param_shardings = tree_shardings(model.logical_axes, mesh, ROLLOUT_RULES, shapes)
  rows, page_size, table = spec["rows"], 16, spec["table_pages"]
  config = PagedConfig(
    page_size=page_size, num_pages=rows * table, max_running=rows, decode_steps=spec["steps"]
  )
  calls = PagedCalls(model, mesh, ROLLOUT_RULES, param_shardings, config)
  calls.decoder(NO_FILTER)
  (params_s, kv_s, state_s, sampling_s, table_s, _), _ = calls._decode_shardings

  def arg(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  params = jax.tree.map(lambda a, s: arg(a.shape, a.dtype, s), model.abstract_params(), params_s)
  pool = (cfg.num_kv_heads, config.num_pages, page_size, cfg.head_dim)
  kv = [(arg(pool, dtype, a), arg(pool, dtype, b)) for a, b in kv_s]
  i32, b = jnp.int32, (rows,)
  state = DecodeState(*(arg(b, i32, s) for s in state_s[:4]), arg(b, jnp.bool_, state_s.live_b))
  sampling = RowSampling(
    arg(b, jnp.uint32, sampling_s.seeds_b),
    arg(b, jnp.float32, sampling_s.temperature_b),
    arg(b, i32, sampling_s.top_k_b),
    arg(b, jnp.float32, sampling_s.top_p_b),
    arg((rows, 4), i32, sampling_s.stop_ids_bs),
  )
  with target_platform("tpu" if tpu else "cuda"):
    lowered = calls.decoders[NO_FILTER].lower(
      params, kv, state, sampling, arg((rows, table), i32, table_s), None
    )
  compiled = lowered.compile()
  memory = compiled.memory_analysis()
  pool_type = f"{'bf16' if dtype == 'bfloat16' else 'f32'}[{','.join(map(str, pool))}]"
  text = compiled.as_text()
  plan = {
    "temp_gib": memory.temp_size_in_bytes / 2**30,
    "argument_gib": memory.argument_size_in_bytes / 2**30,
    # Whole KV pools copied (a layout change XLA inserted), anywhere in the program.
    "pool_copies": len(re.findall(rf"= {re.escape(pool_type)}\S* copy\(", text)),
  }
  if tpu:
    return plan
  dumps = sorted(
    pathlib.Path(spec["dump"]).glob("*_decode_impl*thunk_sequence_after_thunk_passes.txt")
  )
  if not dumps:
    raise RuntimeError(f"XLA wrote no thunk sequence of the decode window to {spec['dump']}.")
  return {**plan, **count_loop_body(dumps[-1].read_text())}


def _run_child(spec: dict, timeout: float) -> dict:
  with tempfile.TemporaryDirectory() as dump:
    # Only a GPU decode window's count (its thunk sequence) and `bench_kernel_code` (the
    # kernels' PTX) read XLA's dump.
    kind = spec.get("kind")
    dump_flags = ""
    if spec["target"] not in TPU_TOPOLOGIES and kind in (None, "code"):
      dump_flags = f" --xla_dump_to={dump}" + (" --xla_gpu_dump_llvmir" if kind else "")
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",  # no CUDA client: the plugin only compiles
      JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",  # its check needs a driver
      TPU_SKIP_MDS_QUERY="1",  # libtpu: no TPU VM's metadata server to ask
      XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + dump_flags,
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
    if any("TPU support not installed" in line for line in tail):
      raise RuntimeError(f"libtpu is not installed: {TPU_HELP}.")
    raise RuntimeError(f"Compiling {spec} failed: " + " | ".join(tail))
  return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_kernels(
  presets=("qwen3-0.6b",),
  rows: tuple[int, ...] = (16, 64),
  decode_steps: int = 8,
  targets: tuple[str, ...] = ("h100", "tpu-v5e"),
  table_pages: int = 64,
  timeout: float = 900.0,
  dtype: str = "bfloat16",
  learner: bool = True,
) -> dict:
  """Each target's compile of the decode window of each preset at each row count.

  GPU targets (`benchmarks/gpu_targets/<name>.txtpb`): launches per decode step, per layer (the
  2-layer build minus the 1-layer build) and the rest (`other`: the 1-layer build minus one
  layer), and XLA's buffer plan (temporaries, arguments, whole KV pools copied). TPU targets
  (`TPU_TOPOLOGIES`): the buffer plan, and the learner's TPU kernels compiled through Mosaic
  (`_compile_training_kernels`). A target whose compiler is not installed gets an
  `error` saying how to install it. `table_pages`: page-table width (pages per row, 16 tokens
  each; 64: 1,024 tokens, about the width the RL job's auto shapes give a 544-token sequence).
  `dtype`: the model's compute, parameter and cache dtype, "bfloat16" or "float32".
  `learner`: also plan the learner's update on each target (`_plan_learner`; several minutes
  of compiling per target on a small machine).
  """
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}.")
  out: dict = {"decode_steps": decode_steps, "table_pages": table_pages, "dtype": dtype}
  for target in targets:
    try:
      out[target] = _bench_target(
        presets, rows, decode_steps, target, table_pages, timeout, dtype, learner
      )
    except RuntimeError as e:
      out[target] = {"error": str(e)}
  return out


def _bench_target(presets, rows, decode_steps, target, table_pages, timeout, dtype, learner):
  if target not in TPU_TOPOLOGIES and not (TARGETS / f"{target}.txtpb").exists():
    known = sorted(p.stem for p in TARGETS.glob("*.txtpb")) + sorted(TPU_TOPOLOGIES)
    raise ValueError(f"Unknown target {target!r}; known: {known}.")
  out: dict = {}
  if target in TPU_TOPOLOGIES:
    out["training_kernels"] = _run_child({"target": target, "kind": "training"}, timeout)
  if learner:
    out["learner"] = _run_child({"target": target, "kind": "learner"}, timeout)
  for preset in presets:
    for n in rows:
      base = {"preset": preset, "rows": n, "steps": decode_steps, "target": target}
      base["dtype"] = dtype
      base["table_pages"] = table_pages
      full = _run_child({**base, "layers": 0}, timeout)
      if target in TPU_TOPOLOGIES:  # memory only: a TPU program has no launches to count
        out[f"{preset}_{n}_rows"] = full
        continue
      one = _run_child({**base, "layers": 1}, timeout)
      two = _run_child({**base, "layers": 2}, timeout)
      layer = collections.Counter(two["kinds"])
      layer.subtract(one["kinds"])
      one_build = collections.Counter(one["kinds"])
      out[f"{preset}_{n}_rows"] = {
        "launches_per_step": full["launches"],
        "in_cuda_graphs": full["in_cuda_graphs"],
        "outside_cuda_graphs": full["outside_cuda_graphs"],
        "loop_condition_launches": full["condition_launches"],
        "per_layer": two["launches"] - one["launches"],
        "other": 2 * one["launches"] - two["launches"],
        "per_layer_kinds": {k: v for k, v in layer.most_common() if v},
        # The embedding, LM head and sampler: one layer's build less one layer.
        "other_kinds": {k: v for k, v in (one_build - layer).most_common() if v > 0},
        **{key: full[key] for key in ("temp_gib", "argument_gib", "pool_copies")},
      }
  return out


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    child_spec = json.loads(sys.argv[2])
    if child_spec.get("kind") == "code":
      from bench_kernel_code import compile_kernel_code as compile_child
    else:
      from bench_kv_shards import plan_kv_shards
      from bench_moe import plan_moe_layer, plan_moe_recipes
      from bench_split import plan_split_kernels

      compile_child = {
        "training": _compile_training_kernels,
        "learner": _plan_learner,
        "apply": _compile_apply,
        "update": _compile_update,
        "engine": _compile_engine,
        "moe_layer": plan_moe_layer,
        "moe_recipes": plan_moe_recipes,
        "split_kernels": plan_split_kernels,
        "kv_shards": plan_kv_shards,
      }.get(child_spec.get("kind"), _compile_window)
    print(json.dumps(compile_child(child_spec)))
  else:
    print(json.dumps(bench_kernels()))
