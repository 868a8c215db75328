"""`jaxrl.model.scan_fit`: the scan over the blocks is kept where its stacked copies fit a share
of a device's memory, and turned off where they do not, in the learner and the paged engine."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from jaxrl.model import Model, get_preset, scan_fit
from jaxrl.rollout import PagedConfig, PagedEngine
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh, tree_shardings
from jaxrl.train import Learner, LossConfig, OptimizerConfig

MODEL = Model(get_preset("tiny", dtype="bfloat16", param_dtype="float32"))


def _shardings(model, mesh, rules=TRAIN_RULES):
  shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
  return tree_shardings(model.logical_axes, mesh, rules, shapes)


def test_a_stacked_copy_counts_each_devices_share_of_the_blocks_in_the_compute_dtype():
  blocks = jax.tree.leaves(MODEL.abstract_params()["blocks"])
  whole = sum(math.prod(x.shape) for x in blocks) * 2  # bf16
  one = make_mesh(jax.devices()[:1], {})
  assert scan_fit.stacked_copy_bytes(MODEL, _shardings(MODEL, one)) == whole
  # fsdp 8 splits every block matrix eight ways (its embedding axis, 128 wide); the norms'
  # scales stay whole on each device.
  fsdp = make_mesh(jax.devices()[:8], {"fsdp": 8})
  split = sum(math.prod(x.shape) // 8 if x.ndim > 1 else math.prod(x.shape) for x in blocks)
  assert scan_fit.stacked_copy_bytes(MODEL, _shardings(MODEL, fsdp)) == split * 2


def test_the_scan_stays_where_the_device_does_not_say_or_has_room(monkeypatch):
  mesh = make_mesh(jax.devices()[:1], {})
  shardings = _shardings(MODEL, mesh)
  assert scan_fit.device_memory(jax.devices()[0]) is None  # a CPU reports no limit
  assert scan_fit.fit_scan(MODEL, mesh, shardings, copies=2) is MODEL
  need = 2 * scan_fit.stacked_copy_bytes(MODEL, shardings)
  roomy = need / scan_fit.SCAN_MEMORY_SHARE
  monkeypatch.setattr(scan_fit, "device_memory", lambda device: roomy)
  assert scan_fit.fit_scan(MODEL, mesh, shardings, copies=2) is MODEL
  monkeypatch.setattr(scan_fit, "device_memory", lambda device: roomy - 1)
  unrolled = scan_fit.fit_scan(MODEL, mesh, shardings, copies=2)
  assert not unrolled.config.scan_layers
  assert unrolled.config == dataclasses.replace(MODEL.config, scan_layers=False)
  # One copy (a packed prefill) still fits where two did not.
  assert scan_fit.fit_scan(MODEL, mesh, shardings, copies=1) is MODEL


def test_the_learner_and_the_engine_turn_the_scan_off_on_a_small_device(monkeypatch):
  monkeypatch.setattr(scan_fit, "device_memory", lambda device: 1024)
  mesh = make_mesh(jax.devices()[:1], {})
  learner = Learner(
    MODEL, mesh, TRAIN_RULES, loss=LossConfig(), optimizer=OptimizerConfig(),
    updates_per_step=1, micro_batch_size=1, temperature=1.0, abstract=True,
  )  # fmt: skip
  engine = PagedEngine(
    MODEL, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0, config=PagedConfig(num_pages=8)
  )
  assert not learner.model.config.scan_layers and not engine.model.config.scan_layers
  assert engine._calls.model is engine.model
  # What runs is the unrolled program: one block's dots per layer, not one block in a scan.
  tokens = jnp.zeros((1, 8), jnp.int32)
  text = jax.jit(learner.model.apply).lower(MODEL.abstract_params(), tokens).as_text()
  assert "while" not in text
  with pytest.raises(AssertionError):
    assert "while" not in jax.jit(MODEL.apply).lower(MODEL.abstract_params(), tokens).as_text()


def test_the_scan_is_off_on_cpu_devices_that_exchange_data():
  """XLA:CPU can deadlock collectives in and after a scan (`scan_fit`'s docstring): for
  programs whose collectives race it (the learner's), on CPU meshes with an fsdp, tensor or
  expert axis over several devices the blocks run unrolled; data-parallel and one-device
  meshes keep the scan, and so do programs that do not race it (the engine's)."""
  devices = jax.devices()[:4]
  for axes, exchanges in [
    ({}, False),
    ({"data": 4}, False),
    ({"fsdp": 4}, True),
    ({"data": 2, "tensor": 2}, True),
    ({"expert": 4}, True),
  ]:
    mesh = make_mesh(devices if axes else devices[:1], axes)
    assert scan_fit.exchanges_on_cpu(mesh) == exchanges, axes
    shardings = _shardings(MODEL, mesh)
    fitted = scan_fit.fit_scan(MODEL, mesh, shardings, copies=2, races_on_cpu=True)
    assert fitted.config.scan_layers != exchanges, axes
    assert scan_fit.fit_scan(MODEL, mesh, shardings, copies=2) is MODEL, axes
