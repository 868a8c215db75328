"""The GPU tools of the benchmarks, on CPU: the kernel census of `launch/bench_kernels.py`
(launches counted in XLA's thunk dumps; kernels chosen for a target platform while tracing)
and the trace summary of `launch/bench_profile.py`."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch"))

from bench_kernels import count_loop_body, flash_kernel_calls  # noqa: E402
from bench_profile import (  # noqa: E402
  busy_microseconds,
  device_kernels,
  parse_block_sizes,
  summarize,
)
from helpers.lowering import TRITON_CALL, export_cuda  # noqa: E402

from jaxrl.kernels import paged_attention  # noqa: E402
from jaxrl.kernels.common import target_platform  # noqa: E402

# The shape of XLA's `*.thunk_sequence_after_thunk_passes.txt` (jax 0.10.2), cut down: set-up
# kernels, a while loop whose condition runs one kernel and whose body runs a command buffer of
# five kernels, a dynamic-slice wrapper around a copy and one more kernel outside any command
# buffer; then a kernel after the loop.
DUMP = """\
000: kCommandBuffer [source       | next=003 (1)]
    001: kCopy         [source | sink] kCopy
    002: kCustomKernel [source | sink] loop_broadcast_fusion grid: [1, 1, 1] threads: [128, 1, 1]
003: kWhile         [prev=000 (1) | next=013 (1)]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    000: kCommandBuffer      [source       | next=010 (1)]
        005: kCustomKernel [source       | next=006 (1) ] fusion_1760 grid: [128, 1, 1]
        006: kCustomKernel [prev=005 (1) | next=007 (1) ] gemm_fusion_dot_310 grid: [2048, 1, 1]
        007: kCustomKernel [prev=006 (1) | next=008 (1) ] paged_attention_gpu grid: [16, 8, 2]
        008: kCustomKernel [prev=007 (1) | next=009 (1) ] gemm_fusion_dot_311 grid: [1024, 1, 1]
        009: kCustomKernel [prev=008 (1) | sink         ] fusion_1759 grid: [16, 1, 1]
    010: kDynamicSliceFusion [prev=000 (1) | sink        ] params=1, results=1
        011: kCopy [source | sink] kCopy
    012: kCustomKernel       [prev=000 (2) | sink        ] loop_add_fusion_28 grid: [1, 1, 1]
013: kCustomKernel  [prev=003 (1) | sink        ] wrapped_add_1 grid: [1, 1, 1]
"""


def test_counts_the_loop_body_by_kernel_kind():
  counts = count_loop_body(DUMP)
  assert counts == {
    "launches": 7,
    "in_cuda_graphs": 5,
    "outside_cuda_graphs": 2,
    "condition_launches": 1,
    "kinds": {
      "fusion": 2,
      "gemm_fusion_dot": 2,
      "paged_attention_gpu": 1,
      "kCopy": 1,
      "loop_add_fusion": 1,
    },
  }


def test_a_dump_without_a_loop_is_an_error():
  with pytest.raises(ValueError, match="No kWhile thunk"):
    count_loop_body(DUMP.split("003: kWhile")[0])


def test_flash_kernel_calls_counts_custom_calls_by_kernel():
  """Custom calls only: an op that names a kernel in its metadata is not a call of it."""
  hlo = "\n".join([
    '  %a = (bf16[1,64,2,16]{3,2,1,0}, f32[1,2,64]{2,1,0}) custom-call(%q, %k, %v), '
    'custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash_attention_fwd_gpu"}',
    '  %b = bf16[1,64,2,16]{3,2,1,0} custom-call(%q, %k), custom_call_target="__gpu$xla.gpu.'
    'triton", backend_config={"name":"flash_attention_dq_gpu"}',
    '  %c = (bf16[1,64,2,16]{3,2,1,0}, f32[1,2,64]{2,1,0}) custom-call(%q2, %k2, %v2), '
    'custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash_attention_fwd_gpu"}',
    '  %d = f32[64]{0} add(%x, %y), metadata={op_name="jit(flash_attention_fwd_gpu)/add"}',
    '  %e = f32[8]{0} custom-call(%z), custom_call_target="tpu_custom_call", '
    'backend_config={"custom_call_config": {"name": "flash_attention_dkv_tpu"}}',
  ])  # fmt: skip
  assert flash_kernel_calls(hlo) == {
    "flash_attention_dkv_tpu": 1,
    "flash_attention_dq_gpu": 1,
    "flash_attention_fwd_gpu": 2,
  }


def _exported_for_cuda(platform):
  shapes = [
    jax.ShapeDtypeStruct((4, 8, 64), jnp.bfloat16),
    jax.ShapeDtypeStruct((4, 32, 16, 64), jnp.bfloat16),
    jax.ShapeDtypeStruct((4, 32, 16, 64), jnp.bfloat16),
    jax.ShapeDtypeStruct((4,), jnp.int32),
    jax.ShapeDtypeStruct((4, 8), jnp.int32),
  ]
  # What matters here is which impl was traced.
  if platform is None:
    return export_cuda(paged_attention, *shapes).mlir_module()
  with target_platform(platform):
    return export_cuda(paged_attention, *shapes).mlir_module()


def test_target_platform_picks_the_kernel_of_the_target_while_tracing():
  # On this CPU machine "auto" traces the reference; inside target_platform("cuda"), the kernel.
  assert TRITON_CALL not in _exported_for_cuda(None)
  assert TRITON_CALL in _exported_for_cuda("cuda")


def test_target_platform_names_the_known_platforms():
  with pytest.raises(ValueError, match="Unknown target platform 'cudda'"), target_platform("cudda"):
    pass


# A Perfetto trace as `jax.profiler` writes it, cut down: a host process and a GPU whose kernels
# name their XLA module; decode kernels overlap once (two streams), a prefill kernel is not ours.
TRACE = {
  "traceEvents": [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "X", "pid": 1, "name": "PjitFunction(_decode_impl)", "ts": 0, "dur": 100},
    {"ph": "X", "pid": 2, "name": "gemm_fusion_dot_3", "ts": 0, "dur": 10,
     "args": {"hlo_module": "jit__decode_impl"}},
    {"ph": "X", "pid": 2, "name": "gemm_fusion_dot_7", "ts": 5, "dur": 10,
     "args": {"hlo_module": "jit__decode_impl"}},
    {"ph": "X", "pid": 2, "name": "paged_attention_gpu", "ts": 20, "dur": 4,
     "args": {"hlo_module": "jit__decode_impl"}},
    {"ph": "X", "pid": 2, "name": "fusion_12", "ts": 40, "dur": 50,
     "args": {"hlo_module": "jit__prefill_impl"}},
  ]
}  # fmt: skip


def test_device_kernels_of_one_module_and_their_busy_time():
  kernels = device_kernels(TRACE, module="decode_impl")
  assert [name for name, _, _ in kernels] == [
    "gemm_fusion_dot_3",
    "gemm_fusion_dot_7",
    "paged_attention_gpu",
  ]
  assert busy_microseconds(kernels) == 19.0  # [0, 15] and [20, 24]
  assert len(device_kernels(TRACE)) == 4  # no module asked for: every device kernel
  # A trace that names its device otherwise: every process but the host's is a device.
  renamed = {"traceEvents": [dict(e) for e in TRACE["traceEvents"]]}
  renamed["traceEvents"][1]["args"] = {"name": "GPU 0"}
  assert len(device_kernels(renamed)) == 4


def test_summary_per_step_by_kernel_kind():
  summary = summarize(device_kernels(TRACE, module="decode_impl"), steps=2)
  assert summary["kernels_per_step"] == 1.5 and summary["busy_us_per_step"] == 9.5
  fields = ("kind", "launches_per_step", "us_per_step", "us_per_launch")
  assert [tuple(kind[f] for f in fields) for kind in summary["kinds"]] == [
    ("gemm_fusion_dot", 1.0, 10.0, 10.0),
    ("paged_attention_gpu", 0.5, 2.0, 4.0),
  ]


def test_parse_block_sizes_reads_c_x_w_s_with_empty_fields_derived():
  from jaxrl.kernels.paged_attention import BlockSizes

  assert parse_block_sizes("2,,2,1") == BlockSizes(2, None, 2, 1)
  assert parse_block_sizes(",,,") == BlockSizes()
  with pytest.raises(ValueError, match="4 comma-separated"):
    parse_block_sizes("2,2")
  with pytest.raises(ValueError, match="power of two"):
    parse_block_sizes("2,,3,1")
