"""Publishing a version to rollout workers of this process (the async loop, `local` backend).

  python launch/bench.py publish [--json] [--presets qwen3-0.6b]

A learner with fp32 master weights (`train.Learner`, fsdp over the first half of the devices)
publishes versions as the asynchronous loop does (`Learner.publish_to`), and two readers take
each one as rollout workers do between decode windows: a bf16 engine's `ParamPlacer` each, on
a quarter of the devices, tensor-parallel over them (with fewer than 4 devices everything
shares them, and nothing moves between devices). The ways below are taken in turn, so that
each meets the same machine state: `repeats` transfers each, after one that compiles.

- `host_fp32`: a host copy in the learner's dtype (before `loop.publish_on_device`);
- `host_bf16`: cast on the training devices, then brought to the host (`publish_on_device=False`);
- `device_bf16`: cast on the training devices and kept there (the default); readers take it
  as engines do by default: on accelerators device to device
  (`jaxrl.sharding.move_between_devices`), on CPU by `device_put` (through the host);
- `device_bf16_d2d`: the same, device to device on CPU too (run only where the default is not).

Reported (medians): `publish_s`, what the learner waits in `publish_to`; `transfer_s`, until
both readers hold their placed weights; the bytes that cross to and from the host and between
devices, by construction. On a CPU the "devices" are host memory: a copy to the host is a
memcpy (or none), so only an accelerator shows what the transfers cost there.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxrl.model import Model, get_preset
from jaxrl.rl.weights import WeightStore
from jaxrl.rollout.engine import ParamPlacer
from jaxrl.sharding import STAGE_RULES, make_mesh, tree_shardings
from jaxrl.train import Learner, LossConfig, OptimizerConfig

WAYS = {  # name -> (cast to the readers' dtype, keep on the training devices, device to device)
  "host_fp32": (False, False, None),
  "host_bf16": (True, False, None),
  "device_bf16": (True, True, None),
  "device_bf16_d2d": (True, True, True),  # where the default is not device to device (CPU)
}


def bench_publish(presets=("qwen3-0.6b",), repeats: int = 3) -> dict:
  """Per preset and way: median seconds of `repeats` publications (see the module docstring)."""
  return {preset: _preset(preset, repeats) for preset in presets}


def _preset(preset: str, repeats: int) -> dict:
  devices = jax.devices()
  if len(devices) >= 4:
    q = len(devices) // 4
    train_devices, reader_devices = devices[: 2 * q], [devices[2 * q : 3 * q], devices[3 * q :]]
  else:  # one accelerator: the stages share it, and nothing moves between devices
    train_devices, reader_devices = devices, [devices, devices]
  shared = len(devices) < 4
  cfg = get_preset(preset)
  learner = Learner(
    Model(dataclasses.replace(cfg, param_dtype="float32")),
    make_mesh(train_devices, {"fsdp": len(train_devices)}),
    STAGE_RULES["train"],
    loss=LossConfig(),
    optimizer=OptimizerConfig(mu_dtype="bfloat16"),
    updates_per_step=1,
    micro_batch_size=len(train_devices),
    temperature=1.0,
  )
  rollout_model = Model(dataclasses.replace(cfg, param_dtype="bfloat16"))
  abstract = rollout_model.abstract_params()
  shapes = jax.tree.map(lambda a: a.shape, abstract)
  reader_shardings = [
    tree_shardings(
      rollout_model.logical_axes,
      make_mesh(group, {"tensor": len(group)}),
      STAGE_RULES["rollout"],
      shapes,
    )
    for group in reader_devices
  ]
  readers = {
    d2d: [ParamPlacer(s, abstract, device_to_device=d2d) for s in reader_shardings]
    for d2d in (None, True)
  }
  ways = {k: v for k, v in WAYS.items() if v[2] is None or not readers[None][0].device_to_device}
  bf16 = jax.tree.map(lambda a: a.dtype, abstract)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(learner.params))
  narrow = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
  times = {way: ([], []) for way in ways}
  store, version = WeightStore(), 0
  for round_ in range(repeats + 1):
    for way, (cast, on_device, d2d) in ways.items():
      start = time.perf_counter()
      learner.publish_to(store, version, dtypes=bf16 if cast else None, on_device=on_device)
      published = time.perf_counter() - start
      _, params = store.pull(version - 1)
      jax.block_until_ready([read(params) for read in readers[d2d]])
      if round_:  # the first compiles the casts and the copies
        times[way][0].append(published)
        times[way][1].append(time.perf_counter() - start)
      version += 1
      del params
  out = {"param_bytes": nbytes, "train_devices": len(train_devices), "readers": 2}
  for way, (cast, on_device, d2d) in ways.items():
    sent = narrow if cast else nbytes
    direct = on_device and not shared and readers[d2d][0].device_to_device
    # Device to device: each reader's pieces go to its first device, are joined there, and the
    # others' parts go on from it (`move_between_devices`). Else through the host: read once
    # (an array keeps its host value), placed once per reader.
    joined = sum(sent * (2 * len(group) - 1) // len(group) for group in reader_devices)
    host = not direct and not (on_device and shared)
    out[way] = {
      "publish_s": float(np.median(times[way][0])),
      "transfer_s": float(np.median(times[way][1])),
      "bytes_to_host": sent if host else 0,
      "bytes_from_host": 2 * sent if host else 0,
      "bytes_between_devices": joined if direct else 0,
    }
  return out
