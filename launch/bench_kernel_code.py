"""`python launch/bench.py kernel_code`: the Pallas GPU kernels' machine code, for a GPU this
machine does not have.

A kernel's time needs the card; some of what decides it does not. This compiles the GPU
kernels of the learner and of the decode step for a target of `benchmarks/gpu_targets` (as
`launch/bench.py kernels` does: the CUDA plugin, no device), has XLA dump each kernel's PTX,
assembles it with ptxas for the PTX's own architecture (`sm_90a` for an H100), and reports for
each Pallas kernel:

- `registers` a thread, and the bytes ptxas spilled to local memory (`spill_stores`,
  `spill_loads`): a kernel that spills reads and writes memory in its inner loop;
- static instruction counts of the PTX: `instructions`, `float_ops` (float32 / bf16
  arithmetic, compares, selects and conversions: the elementwise work around the matmuls),
  `ex2` (the special-function unit's exponentials), `wgmma` (Hopper's asynchronous
  tensor-core MMAs), `mma_sync` (the older synchronous ones), `stmatrix` (register tiles
  written to shared memory: Triton's layout conversions, such as a transposed register
  operand) and `barriers` (`bar.sync`: the block waits for all its warps).

The counts are of the unrolled code, not of executed instructions: compare them between
settings of one kernel (`natural_exp` against the default, a tiling against another), never
across kernels. Programs (`PROGRAMS`): flash attention's forward and backward at Qwen3-0.6B's
heads over one packed row of 4,096 tokens, in bf16 by default and under
`pallas_gpu.natural_exp` (the kernel's A/B setting that changes its code; `mask_every_block`
changes only where its loops start and end, at run time), and in float32; the grouped matmul
(at the target's default tiles) and its weight gradient (at its default tiles and at 64 x 64 x
128) at Qwen3-30B-A3B's expert shapes (8,192 rows, 128 groups); the paged decode attention at
64 rows. `flash_blocks`: also compile flash attention at each of these tilings
(`benchmarks/flash_attention_tuning.py`'s candidates, to see which spill before timing them).

Needs the CUDA plugin (`launch/bench_kernels.py` says how to install it), whose
`nvidia-cuda-nvcc` package holds ptxas; each program compiles in a process of its own.
"""

from __future__ import annotations

import collections
import contextlib
import pathlib
import re
import shutil
import subprocess
import sys

from bench_kernels import TARGETS, _run_child, _target_devices

# name -> the program's spec: what it runs, the A/B setting of the flash kernel it is traced
# under, the `BlockSizes` fields of its kernel.
PROGRAMS = {
  "flash_4096": {"program": "flash"},
  "flash_4096_natural_exp": {"program": "flash", "setting": "natural_exp"},
  "flash_4096_float32": {"program": "flash", "dtype": "float32"},
  "gmm_8192x2048x768_128_groups": {"program": "gmm"},
  "tgmm_8192x2048x768_128_groups": {"program": "tgmm"},
  # The small tiles tgmm had on Hopper before the H100 sweep (docs/BENCHMARKS.md).
  "tgmm_8192x2048x768_128_groups_64x32x64": {
    "program": "tgmm",
    "blocks": {"tm": 64, "tk": 32, "tn": 64, "num_warps": 4, "num_stages": 2},
  },
  "paged_attention_64_rows": {"program": "paged_attention"},
}
_KERNEL_ENTRY = re.compile(r"^\.(?:visible )?\.?entry (\w+)", re.M)
_FLOAT_OP = re.compile(
  r"^(add|sub|mul|fma|max|min|neg|abs|selp|setp|cvt|ex2|lg2|rcp|div)\..*(f32|bf16|f16)"
)


def ptx_instruction_counts(ptx: str) -> dict[str, int]:
  """Static counts of a PTX kernel's instructions (see the module's docstring)."""
  opcodes = collections.Counter()
  for line in ptx.splitlines():
    match = re.match(r"\s+(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", line)
    if match and not line.lstrip().startswith("//"):
      opcodes[match[1]] += 1
  return {
    "instructions": sum(opcodes.values()),
    "float_ops": sum(n for op, n in opcodes.items() if _FLOAT_OP.match(op)),
    "ex2": sum(n for op, n in opcodes.items() if op.startswith("ex2.")),
    "wgmma": sum(n for op, n in opcodes.items() if op.startswith("wgmma.mma_async")),
    "mma_sync": sum(n for op, n in opcodes.items() if op.startswith("mma.sync")),
    "stmatrix": sum(n for op, n in opcodes.items() if op.startswith("stmatrix")),
    "barriers": sum(n for op, n in opcodes.items() if op.startswith("bar.")),
  }


def ptxas_resources(report: str) -> dict[str, int]:
  """Registers and spilled bytes of the one kernel in ptxas's `-v` report."""
  registers = re.search(r"Used (\d+) registers", report)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
  if not registers or not spills:
    raise ValueError(f"No register or spill figures in ptxas's report: {report[:300]!r}")
  return {
    "registers": int(registers[1]),
    "spill_stores": int(spills[1]),
    "spill_loads": int(spills[2]),
  }


def _ptxas() -> str:
  for entry in sys.path:
    candidate = pathlib.Path(entry or ".") / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    if candidate.is_file():
      return str(candidate)
  found = shutil.which("ptxas")
  if not found:
    raise RuntimeError(
      "No ptxas: install the CUDA plugin with its nvcc package (launch/bench_kernels.py) "
      "or put CUDA's ptxas on PATH."
    )
  return found


def _pallas_kernels(dump: str) -> dict[str, dict]:
  """Each Pallas kernel's figures from the PTX files XLA dumped (`--xla_gpu_dump_llvmir`)."""
  ptxas = _ptxas()
  out = {}
  for path in sorted(pathlib.Path(dump).glob("*.ptx")):
    ptx = path.read_text()
    entry = _KERNEL_ENTRY.search(ptx)
    if not entry or not entry[1].endswith("_gpu"):  # XLA's own fusions end otherwise
      continue
    arch = re.search(r"^\.target (\w+)", ptx, re.M)[1]
    cubin = pathlib.Path(dump) / f"{path.stem}.cubin"
    report = subprocess.run(
      [ptxas, f"-arch={arch}", "-v", str(path), "-o", str(cubin)],
      capture_output=True,
      text=True,
      check=True,
    ).stderr
    out[entry[1]] = {"arch": arch, **ptxas_resources(report), **ptx_instruction_counts(ptx)}
  if not out:
    raise RuntimeError(f"XLA dumped no PTX of a Pallas kernel to {dump}.")
  return out


def _compute_capability(target: str) -> str:
  """ "9.0" for a target whose `benchmarks/gpu_targets` file says major 9, minor 0."""
  text = (TARGETS / f"{target}.txtpb").read_text()
  match = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)\s*minor:\s*(\d+)", text)
  if not match:
    raise ValueError(f"No cuda_compute_capability in {target}.txtpb.")
  return f"{match[1]}.{match[2]}"


def _program(spec: dict):
  """(function, abstract arguments) of `spec["program"]` on the target's first device."""
  import jax
  import jax.numpy as jnp

  from jaxrl.kernels import gmm, tgmm
  from jaxrl.kernels.flash_attention import BlockSizes, flash_attention
  from jaxrl.kernels.gmm import BlockSizes as GmmBlockSizes
  from jaxrl.kernels.gmm.pallas_gpu import gmm_block_sizes, tgmm_block_sizes
  from jaxrl.kernels.paged_attention import paged_attention

  mesh = jax.sharding.Mesh(_target_devices(spec["target"])[:1], ("x",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def arg(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

  program = spec["program"]
  if program == "flash":
    n = 4096
    blocks = BlockSizes(**spec["blocks"]) if spec.get("blocks") else None
    dtype = jnp.dtype(spec.get("dtype", "bfloat16"))

    def attention_loss(q, k, v, segments, positions):
      out = flash_attention(
        q, k, v, q_segment_ids=segments, kv_segment_ids=segments, q_positions=positions,
        kv_positions=positions, impl="pallas_gpu", block_sizes=blocks,
      )  # fmt: skip
      return jnp.sum(out.astype(jnp.float32))

    shapes = ((1, n, 16, 128), (1, n, 8, 128), (1, n, 8, 128))
    ids = (arg((1, n), jnp.int32), arg((1, n), jnp.int32))
    qkv = (arg(shape, dtype) for shape in shapes)
    return jax.grad(attention_loss, argnums=(0, 1, 2)), (*qkv, *ids)
  rows, groups = 8192, 128
  if program == "gmm":
    # Without a device gmm cannot ask the GPU's compute capability: give it the target's tiles.
    tiles = gmm_block_sizes(rows, groups, 2, _compute_capability(spec["target"]))
    fn = lambda lhs, rhs, sizes: gmm(lhs, rhs, sizes, impl="pallas_gpu", block_sizes=tiles)  # noqa: E731
    return fn, (arg((rows, 2048)), arg((groups, 2048, 768)), arg((groups,), jnp.int32))
  if program == "tgmm":
    tiles = GmmBlockSizes(**spec["blocks"]) if spec.get("blocks") else None
    tiles = tiles or tgmm_block_sizes(2, _compute_capability(spec["target"]))
    fn = lambda lhs, grad, sizes: tgmm(lhs, grad, sizes, impl="pallas_gpu", block_sizes=tiles)  # noqa: E731
    return fn, (arg((rows, 2048)), arg((rows, 768)), arg((groups,), jnp.int32))
  if program == "paged_attention":
    seqs, pages, page_size = 64, 64, 16  # 1,024 tokens of table a row
    pool = arg((8, seqs * pages, page_size, 128))
    fn = lambda q, k, v, lengths, table: paged_attention(  # noqa: E731
      q, k, v, lengths, table, impl="pallas_gpu"
    )
    ints = (arg((seqs,), jnp.int32), arg((seqs, pages), jnp.int32))
    return fn, (arg((seqs, 16, 128)), pool, pool, *ints)
  raise ValueError(f"Unknown program {program!r}; known: flash, gmm, tgmm, paged_attention.")


def compile_kernel_code(spec: dict) -> dict:
  """In a fresh process started by `_run_child` (XLA dumping PTX to `spec["dump"]`): compiles
  `spec["program"]` for `spec["target"]` and returns each Pallas kernel's figures."""
  import jax

  from jaxrl.kernels.common import target_platform
  from jaxrl.kernels.flash_attention import pallas_gpu

  fn, args = _program(spec)
  setting = getattr(pallas_gpu, spec["setting"])() if spec.get("setting") else None
  with target_platform("cuda"), setting or contextlib.nullcontext():
    jax.jit(fn).lower(*args).compile()
  return _pallas_kernels(spec["dump"])


def bench_kernel_code(
  target: str = "h100", flash_blocks: tuple[dict, ...] = (), timeout: float = 900.0
) -> dict:
  """Each program's Pallas kernels, compiled for `target`: name -> kernel -> figures (or the
  compile's error). `flash_blocks`: `BlockSizes` fields of flash attention tilings to compile
  too (`flash_4096_<fields>`)."""
  runs = dict(PROGRAMS)
  for blocks in flash_blocks:
    label = "_".join(f"{k}{v}" for k, v in sorted(blocks.items()))
    runs[f"flash_4096_{label}"] = {"program": "flash", "blocks": blocks}
  out: dict = {"target": target}
  for name, run in runs.items():
    try:
      out[name] = _run_child({**run, "target": target, "kind": "code"}, timeout)
    except RuntimeError as e:
      out[name] = {"error": str(e)}
  return out


def parse_flash_blocks(text: str) -> tuple[dict, ...]:
  """`--flash-blocks "block_q=64,num_warps=4;block_kv_bwd=128"` -> BlockSizes fields per
  tiling; a clear exit for anything else."""
  from jaxrl.kernels.flash_attention import BlockSizes  # as this module's programs: when run

  tilings = []
  for tiling in text.split(";"):
    try:
      fields = {k.strip(): int(v) for k, v in (field.split("=") for field in tiling.split(","))}
      BlockSizes(**fields)
    except (ValueError, TypeError) as e:
      raise SystemExit(
        f"--flash-blocks: {tiling!r} is not BlockSizes fields as name=int separated by commas "
        f'(tilings by semicolons), e.g. "block_q_bwd=32,block_kv_bwd=128": {e}'
      ) from None
    tilings.append(fields)
  return tuple(tilings)
