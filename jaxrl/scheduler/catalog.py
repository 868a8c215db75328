"""Accelerator types: peak rates, memory, links and prices the cost model plans with.

Every figure in `CATALOG` is APPROXIMATE: vendor datasheet peaks (bf16 dense tensor FLOP/s,
no sparsity; HBM bandwidth; the device-to-device link inside one node, one direction) and
typical 2025-2026 public-cloud list prices per device-hour, on demand and preemptible (spot).
Prices vary by provider and month: a cluster spec overrides any field (`overrides` of
`configs/clusters/*.py`), and the efficiency factors are meant to be fitted from measured runs
(`fit_decode_efficiency`). The `cpu` entry holds this project's measurement of the local CPU
(`launch/bench.py calibrate`, 2026-11-22); `calibrate_cpu()` measures it again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

GB = 1e9
GIB = 2**30
TERA = 1e12


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One accelerator type, in SI units (bytes, bytes/s, FLOP/s, $ per device-hour).

  Attributes:
    name: catalog key (`H100`, `v5e`, `cpu`, ...).
    platform: "gpu", "tpu" or "cpu".
    flops: peak dense bf16 FLOP/s (V100: fp16, it has no bf16).
    memory_bytes: device memory.
    hbm_bytes_per_s: device memory bandwidth.
    link_bytes_per_s: device-to-device bandwidth inside one node (NVLink, ICI, PCIe), one way.
    price_on_demand: $ per device-hour.
    price_preemptible: $ per device-hour on spot / preemptible capacity.
    decode_efficiency: fraction of `hbm_bytes_per_s` a decode step reaches.
    compute_efficiency: fraction of `flops` prefill and decode matmuls reach.
    train_mfu: model FLOP utilisation of a training step.
    step_overhead_s: fixed cost of one decode step (kernel launches, host round trip).
    approximate: True for datasheet / list-price figures, False for measured ones.
  """

  name: str
  platform: str
  flops: float
  memory_bytes: float
  hbm_bytes_per_s: float
  link_bytes_per_s: float
  price_on_demand: float
  price_preemptible: float
  decode_efficiency: float = 0.7
  compute_efficiency: float = 0.5
  train_mfu: float = 0.4
  step_overhead_s: float = 1e-3
  approximate: bool = True

  def __post_init__(self):
    if self.platform not in ("gpu", "tpu", "cpu"):
      raise ValueError(f"accelerator {self.name}: platform must be gpu, tpu or cpu.")
    for name in ("flops", "memory_bytes", "hbm_bytes_per_s", "link_bytes_per_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"accelerator {self.name}: {name} must be > 0, got {getattr(self, name)}.")
    for name in ("decode_efficiency", "compute_efficiency", "train_mfu"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(
          f"accelerator {self.name}: {name} must be in (0, 1], got {getattr(self, name)}."
        )
    if self.price_on_demand < 0 or self.price_preemptible < 0 or self.step_overhead_s < 0:
      raise ValueError(f"accelerator {self.name}: prices and step_overhead_s must be >= 0.")

  def price(self, preemptible: bool) -> float:
    return self.price_preemptible if preemptible else self.price_on_demand


def _entry(name, platform, tflops, mem_gib, hbm_tbps, link_gbps, on_demand, spot, **kw):
  return Accelerator(
    name=name,
    platform=platform,
    flops=tflops * TERA,
    memory_bytes=mem_gib * GIB,
    hbm_bytes_per_s=hbm_tbps * TERA,
    link_bytes_per_s=link_gbps * GB,
    price_on_demand=on_demand,
    price_preemptible=spot,
    **kw,
  )


# name: platform, bf16 TFLOP/s, memory GiB, HBM TB/s, intra-node link GB/s, $/h, spot $/h.
CATALOG: dict[str, Accelerator] = {
  a.name: a
  for a in (
    _entry("H100", "gpu", 989, 80, 3.35, 450, 4.00, 2.00),
    _entry("H200", "gpu", 989, 141, 4.8, 450, 4.50, 2.30),
    _entry("A100-80GB", "gpu", 312, 80, 2.04, 300, 2.50, 1.10),
    _entry("A40", "gpu", 150, 48, 0.696, 32, 0.80, 0.40),
    _entry("L40S", "gpu", 362, 48, 0.864, 32, 1.20, 0.60),
    _entry("L4", "gpu", 121, 24, 0.30, 32, 0.70, 0.30),
    _entry("V100", "gpu", 125, 32, 0.90, 150, 2.50, 0.75),
    _entry("RTX4090", "gpu", 165, 24, 1.01, 32, 0.40, 0.25),
    _entry("MI300X", "gpu", 1307, 192, 5.3, 448, 3.50, 1.80, decode_efficiency=0.6),
    _entry("v4", "tpu", 275, 32, 1.2, 300, 3.22, 1.45),
    _entry("v5e", "tpu", 197, 16, 0.82, 200, 1.20, 0.60),
    _entry("v5p", "tpu", 459, 95, 2.76, 600, 4.20, 2.10),
    _entry("v6e", "tpu", 918, 32, 1.64, 448, 2.70, 1.35),
    # One of the 8 simulated devices of this 2-core VM (they share its cores and memory, so
    # each gets 1/8 of the machine). Measured 2026-11-22 by `launch/bench.py calibrate`: the
    # machine copies at 61 GB/s and multiplies 1024^3 fp32 at 374 GFLOP/s; the paged engine's
    # decode steps (bench-tiny and bench-small, batch 1-64) fit efficiency 0.26 on the
    # roofline plus 0.1 ms per step (docs/BENCHMARKS.md). Training MFU is not measured here.
    _entry(
      "cpu",
      "cpu",
      0.374 / 8,  # TFLOP/s
      3,  # GiB: 24 GiB of RAM over 8 devices
      0.061 / 8,  # TB/s
      61 / 8,  # GB/s: devices "link" through the same memory
      0.0,
      0.0,
      decode_efficiency=0.26,
      compute_efficiency=0.26,
      train_mfu=0.2,
      step_overhead_s=1e-4,
      approximate=False,
    ),
  )
}


def with_overrides(
  catalog: Mapping[str, Accelerator], overrides: Mapping[str, Mapping[str, float]]
) -> dict[str, Accelerator]:
  """The catalog with fields replaced, e.g. `{"H100": {"price_preemptible": 1.6}}`."""
  out = dict(catalog)
  for name, fields in overrides.items():
    if name not in out:
      raise ValueError(f"overrides name accelerator {name!r}; the catalog has {sorted(out)}.")
    known = {f.name for f in dataclasses.fields(Accelerator)} - {"name"}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(
        f"overrides[{name!r}] has unknown field(s) {unknown}; an accelerator has {sorted(known)}."
      )
    out[name] = dataclasses.replace(out[name], **dict(fields))
  return out


def calibrate_cpu(devices_sharing: int = 8, size_mb: int = 64, n: int = 1024) -> Accelerator:
  """The `cpu` entry measured on this machine now (~1 s): bandwidth and FLOP/s of the whole
  machine divided among the `devices_sharing` simulated devices that share it."""
  import jax
  import numpy as np

  device = jax.devices("cpu")[0]

  def best(fn, repeats=5):
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(repeats):
      out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats

  state = {"x": jax.device_put(np.ones(size_mb * 2**18, np.float32), device)}
  bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # in place: no page faults measured

  def copy():
    state["x"] = bump(state["x"])
    return state["x"]

  a = jax.device_put(np.ones((n, n), np.float32), device)
  matmul = jax.jit(lambda x: x @ x)
  return dataclasses.replace(
    CATALOG["cpu"],
    hbm_bytes_per_s=2 * size_mb * 2**20 / best(copy) / devices_sharing,
    flops=2 * n**3 / best(lambda: matmul(a)) / devices_sharing,
  )


def fit_decode_efficiency(
  accelerator: Accelerator, steps: Sequence[tuple[float, float, float]]
) -> Accelerator:
  """Fits `decode_efficiency` and `step_overhead_s` to measured decode steps.

  Args:
    accelerator: the type the steps ran on (its peak bandwidth and FLOP/s are kept).
    steps: (roofline_seconds, measured_seconds, weight) per measured configuration, where
      roofline_seconds is the cost model's ideal step time (`cost.decode_roofline_seconds`).

  The model is measured = overhead + roofline / efficiency, fitted by weighted least squares;
  at least two distinct roofline times are needed.
  """
  import numpy as np

  if len({round(r, 12) for r, _, _ in steps}) < 2:
    raise ValueError("fit_decode_efficiency needs steps at two or more distinct roofline times.")
  roof, measured, weight = (np.asarray(c, float) for c in zip(*steps, strict=True))
  a = np.stack([np.ones_like(roof), roof], axis=1) * np.sqrt(weight)[:, None]
  (overhead, slope), *_ = np.linalg.lstsq(a, measured * np.sqrt(weight), rcond=None)
  if slope <= 0:
    raise ValueError(
      "fit_decode_efficiency: measured step times do not grow with the roofline time; "
      "measure a wider range of batch sizes or contexts."
    )
  return dataclasses.replace(
    accelerator,
    decode_efficiency=float(min(1.0, 1.0 / slope)),
    step_overhead_s=float(max(0.0, overhead)),
    approximate=False,
  )
