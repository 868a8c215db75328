"""Learner tests on a 4-device training mesh: accumulation, NaN handling, KL reference."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import tolerance
from helpers.compiles import compiled_functions
from helpers.train_batches import random_batch

from jaxrl import compile_ahead
from jaxrl.model import Model, get_preset, scan_fit
from jaxrl.rl.experience import batch_lengths, pad_sequences
from jaxrl.rl.weights import WeightStore
from jaxrl.sharding import TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, OptimizerConfig, TrainBatch, update_plan

MODEL = Model(get_preset("tiny"))


def make_learner(
  micro,
  kl_weight=0.0,
  updates=1,
  params=None,
  eps=1e-8,
  loss=None,
  pack=0,
  grad_dtype="float32",
  axes=None,
):
  mesh = make_mesh(jax.devices()[4:], axes or {"fsdp": 2, "tensor": 2})
  return Learner(
    MODEL,
    mesh,
    TRAIN_RULES,
    loss=loss or LossConfig(kl_weight=kl_weight),
    optimizer=OptimizerConfig(learning_rate=1e-3, eps=eps, grad_accum_dtype=grad_dtype),
    updates_per_step=updates,
    micro_batch_size=micro,
    temperature=1.0,
    params=params,
    pack_length=pack,
  )


def loss_scale(learner, batch) -> float:
  logp_bt = learner.logprobs(learner.params, batch.tokens_bt)
  return tolerance.policy_loss_scale(
    logp_bt, batch.old_logp_bt, batch.advantages_b, batch.mask_bt, computed_logp=True
  )


def test_micro_batching_does_not_change_the_update():
  rng = np.random.default_rng()
  batch = random_batch(rng)
  params = MODEL.init(int(rng.integers(1 << 16)))
  # A large Adam eps makes the first step ~ lr * gradient instead of ~ lr * sign(gradient), so
  # the parameters show the gradient's scale and tiny round-off cannot flip a sign.
  a, b = make_learner(16, params=params, eps=1.0), make_learner(4, params=params, eps=1.0)
  scale = loss_scale(a, batch)
  ma, mb = a.update(batch), b.update(batch)
  # The loss sums terms of either sign and may come out near 0: its tolerance is absolute. The
  # others sum positive terms (or count), which a relative tolerance suits.
  terms = tolerance.model_terms(MODEL.config, tokens=batch.mask_bt.size)
  tolerance.assert_close(mb["loss"], ma["loss"], n=terms, scale=scale, err_msg="loss")
  for key in ("grad_norm", "clip_frac", "ratio_mean"):
    assert float(ma[key]) == pytest.approx(float(mb[key]), rel=1e-4), key
  terms = tolerance.update_terms(MODEL.config, params, batch.mask_bt.size)
  tolerance.assert_same_update(b.params, a.params, params, n=terms)
  changed = [
    np.any(np.asarray(x) != np.asarray(y))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(params), strict=True)
  ]
  assert all(changed)


# The padded path (packing off) is held equal to the packed one by tests/train/packing_test.py;
# its variant here is `slow`.
PACKED_AND_PADDED = [
  pytest.param(0, id="padded", marks=pytest.mark.slow),
  pytest.param(24, id="packed"),
]


@pytest.mark.parametrize("pack", PACKED_AND_PADDED)
def test_gradients_summed_in_bf16_update_like_fp32(pack):
  """`grad_accum_dtype="bfloat16"`: the sum over 4 micro-batches is stored in bf16, and the
  update it gives is the fp32 sum's to bf16's rounding (8 bits of mantissa)."""
  rng = np.random.default_rng(7)
  batch = random_batch(rng)
  params = MODEL.init(3)
  wide = make_learner(4, params=params, eps=1.0, pack=pack)
  narrow = make_learner(4, params=params, eps=1.0, pack=pack, grad_dtype="bfloat16")
  sums = jax.eval_shape(narrow._programs.zero_gradients, params)
  assert {x.dtype for x in jax.tree.leaves(sums)} == {np.dtype(jax.numpy.bfloat16)}
  mw, mn = jax.device_get(wide.update(batch)), jax.device_get(narrow.update(batch))
  assert mn["skipped"] == 0 and mw["loss"] == mn["loss"]  # the forward is untouched
  assert float(mn["grad_norm"]) == pytest.approx(float(mw["grad_norm"]), rel=2**-6)
  for w, n, p in zip(
    *(jax.tree.leaves(x) for x in (wide.params, narrow.params, params)), strict=True
  ):
    step_w, step_n = np.asarray(w) - np.asarray(p), np.asarray(n) - np.asarray(p)
    assert np.dtype(n.dtype) == np.float32  # the master weights stay fp32
    # eps=1 makes the step ~ lr * gradient: bf16's rounding (the sum, then the clipped
    # gradient and its square inside Adam), on the step's own scale. A lost or doubled
    # micro-batch would be off by a quarter.
    np.testing.assert_allclose(step_n, step_w, rtol=0, atol=2**-5 * np.abs(step_w).max() + 1e-12)
  # ... and the rounding did happen: the option reaches the path that sums the gradients.
  differs = [
    np.any(np.asarray(w) != np.asarray(n))
    for w, n in zip(*(jax.tree.leaves(x) for x in (wide.params, narrow.params)), strict=True)
  ]
  assert any(differs)


@pytest.mark.parametrize("pack", PACKED_AND_PADDED)
def test_non_finite_loss_skips_the_update(pack):
  rng = np.random.default_rng()
  batch = random_batch(rng)
  batch.advantages_b[3] = np.nan
  learner = make_learner(8, pack=pack)
  before = jax.tree.map(np.asarray, learner.params)
  metrics = jax.device_get(learner.update(batch))
  assert metrics["skipped"] == 1 and not np.isfinite(metrics["loss"])
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(learner.params), strict=True):
    np.testing.assert_array_equal(x, np.asarray(y))


def test_reference_copy_only_with_kl():
  assert make_learner(8).ref_params is None
  rng = np.random.default_rng()
  learner = make_learner(8, kl_weight=0.1, updates=2)
  assert learner.ref_params is not None
  batch = random_batch(rng)
  first = jax.device_get(learner.update(batch))
  second = jax.device_get(learner.update(batch))
  assert first["kl"] >= 0 and second["kl"] > 0


def test_reset_reference_makes_the_current_policy_the_reference():
  """After a supervised warm-up the KL term must pull towards the warmed-up policy (the one RL
  starts from), not the weights the learner was built with; the reference is a copy, which the
  updates (donating the parameters) leave alone."""
  from jaxrl.train import SupervisedTrainer

  rng = np.random.default_rng()
  learner = make_learner(8, kl_weight=0.1)
  batch = random_batch(rng)
  sft = SupervisedTrainer(learner, 1e-2)
  for _ in range(3):
    sft.step(batch.tokens_bt, batch.mask_bt)
  leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]  # noqa: E731
  assert any(
    not np.array_equal(p, r)
    for p, r in zip(leaves(learner.params), leaves(learner.ref_params), strict=True)
  )
  learner.reset_reference()
  warmed = leaves(learner.params)
  for p, r in zip(warmed, leaves(learner.ref_params), strict=True):
    np.testing.assert_array_equal(p, r)
  # The first update sees the reference policy itself: its KL is 0 (the old log-probs are the
  # current policy's, so the ratio is 1).
  old = np.asarray(learner.logprobs(learner.params, batch.tokens_bt)) * (batch.mask_bt > 0)
  metrics = jax.device_get(learner.update(dataclasses.replace(batch, old_logp_bt=old)))
  assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
  for w, r in zip(warmed, leaves(learner.ref_params), strict=True):
    np.testing.assert_array_equal(w, r)  # the update moved the parameters, not the reference
  # Assigned (a checkpoint's host arrays): copied onto the parameters' shardings.
  learner.ref_params = jax.tree.map(np.zeros_like, jax.device_get(learner.params))
  for r, p in zip(
    jax.tree.leaves(learner.ref_params), jax.tree.leaves(learner.params), strict=True
  ):
    assert r.sharding == p.sharding and not np.any(np.asarray(r))
  with pytest.raises(ValueError, match="kl_weight is 0"):
    make_learner(8).ref_params = learner.params


def test_batch_size_checks():
  learner = make_learner(8, updates=2)
  with pytest.raises(ValueError, match="updates_per_step"):
    learner.check_batch_size(24)
  with pytest.raises(ValueError, match="data\\*fsdp"):
    make_learner(3).check_batch_size(12)


def test_decoupled_ppo_recomputes_the_proximal_policy():
  rng = np.random.default_rng()
  batch = random_batch(rng)
  params = MODEL.init(int(rng.integers(1 << 16)))
  plain = make_learner(8, params=params)
  # Behaviour log-probs equal to the learner's own: the decoupled update is the plain PPO update
  # against those log-probs, with every behaviour weight 1.
  batch.old_logp_bt = plain.proximal_logprobs(batch).astype(np.float32)
  decoupled = make_learner(
    8,
    params=params,
    loss=LossConfig(proximal="recompute", behaviour_correction="truncate", behaviour_cap=1.5),
  )
  scale = loss_scale(plain, batch)
  ma, mb = plain.update(batch), decoupled.update(batch)
  terms = tolerance.model_terms(MODEL.config, tokens=batch.mask_bt.size)
  tolerance.assert_close(mb["loss"], ma["loss"], n=terms, scale=scale)
  # Each weight is exp of the difference of two evaluations of the same log-prob.
  logp_scale = np.abs(batch.old_logp_bt).max()
  tolerance.assert_close(mb["behaviour_weight_mean"], 1.0, n=terms, scale=logp_scale)
  assert float(mb["behaviour_ess"]) == pytest.approx(1.0, abs=1e-4)
  # Stale behaviour log-probs: weights spread, some are truncated, the ESS drops below 1.
  stale = make_learner(
    8,
    params=params,
    loss=LossConfig(proximal="recompute", behaviour_correction="truncate", behaviour_cap=1.5),
  )
  noise = rng.normal(0.0, 0.7, batch.old_logp_bt.shape).astype(np.float32)
  batch.old_logp_bt = np.where(batch.mask_bt > 0, batch.old_logp_bt + noise, 0.0)
  mc = stale.update(batch)
  assert 0 < float(mc["behaviour_adjusted_frac"]) < 1
  assert float(mc["behaviour_ess"]) < 0.95


def test_precompile_compiles_each_length_and_trains_nothing():
  rng = np.random.default_rng()
  learner = make_learner(8, loss=LossConfig(proximal="recompute"))
  params, opt_state = jax.device_get((learner.params, learner.opt_state))
  assert learner.precompile(16, [16, 24]) == 2
  for x, y in zip(
    jax.tree.leaves((params, opt_state)),
    jax.tree.leaves(jax.device_get((learner.params, learner.opt_state))),
    strict=True,
  ):
    np.testing.assert_array_equal(x, y)
  compiled = learner.compiled_shapes("update"), learner.compiled_shapes("logprobs")
  for _ in range(2):  # length 24: no new compilation, with the state the first one returned
    learner.update(random_batch(rng))
  assert (learner.compiled_shapes("update"), learner.compiled_shapes("logprobs")) == compiled
  prompts, responses = [[5] * 3] * 16, [[7] * 2] * 16
  tokens, mask = pad_sequences(prompts, responses, 0, length=32)
  learner.update(TrainBatch(tokens, mask, np.zeros_like(mask), np.ones(16, np.float32)))
  assert learner.compiled_shapes("update") == compiled[0] + 1  # 32 was not precompiled


@pytest.mark.parametrize(
  ("axes", "pack", "kl", "updates"),
  [({"fsdp": 2, "tensor": 2}, 24, 0.1, 1), ({"data": 4}, 24, 0.0, 1), ({"fsdp": 4}, 0, 0.0, 2)],
  ids=["packed-kl", "packed-data-parallel", "padded-2-updates"],
)
def test_the_first_update_runs_what_compile_ahead_compiled(axes, pack, kl, updates):
  """The programs compiled ahead (on background threads, from shapes alone) are the ones the
  first update runs: it compiles none of them again, and updates as a learner that compiled
  them itself."""
  rng = np.random.default_rng(11)
  batch, params = random_batch(rng), MODEL.init(int(rng.integers(1 << 16)))

  def learner():
    return Learner(
      MODEL,
      make_mesh(jax.devices()[4:], axes),
      TRAIN_RULES,
      loss=LossConfig(kl_weight=kl),
      optimizer=OptimizerConfig(learning_rate=1e-3),
      updates_per_step=updates,
      micro_batch_size=4,
      temperature=1.0,
      params=params,
      pack_length=pack,
    )

  ahead, plain = learner(), learner()
  with compiled_functions() as compiled_ahead:
    ahead.compile_ahead(16, [] if pack else [24])  # padded: the batch's length
    ahead._compiling.result()
  expected = {"jit(apply)", "jit(zero_sums)"} if pack else {"jit(update)"}
  assert expected <= set(compiled_ahead)
  with compiled_functions() as compiled_by_update:
    got = ahead.update(batch)
  assert not set(compiled_by_update) & set(compiled_ahead), compiled_by_update
  want = plain.update(batch)
  assert float(got["loss"]) == float(want["loss"])
  for x, y in zip(jax.tree.leaves(ahead.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_failed_compile_ahead_surfaces_at_the_next_update(monkeypatch):
  def broken(lower, stop=None):
    raise RuntimeError("out of memory while compiling")

  monkeypatch.setattr(compile_ahead, "_compile", broken)
  learner = make_learner(4, pack=24)
  batch = random_batch(np.random.default_rng(2))
  learner.compile_ahead(16)
  with pytest.raises(RuntimeError, match="out of memory while compiling"):
    learner.update(batch)
  monkeypatch.undo()
  assert np.isfinite(float(learner.update(batch)["loss"]))  # it compiles what it needs itself


@pytest.mark.parametrize(
  ("dtype", "on_device"),
  [("bfloat16", True), (None, True), ("bfloat16", False)],
  ids=["bf16-device", "own-dtype-device", "bf16-host"],
)
def test_a_published_copy_is_in_the_readers_dtype_and_outlives_the_next_update(dtype, on_device):
  """The async loop's publication: a copy cast to the readers' dtype on the training devices,
  kept there (no device-to-host transfer) or brought to the host; the next update donates the
  parameters and the copy stays whole; each publication runs one compiled program."""
  rng = np.random.default_rng(0)
  learner = make_learner(4, pack=24)
  store = WeightStore()
  dtypes = None if dtype is None else jax.tree.map(lambda x: np.dtype(dtype), learner.params)
  copies_compiled = []
  for version in range(2):
    before = jax.device_get(learner.params)
    shardings = jax.tree.map(lambda x: x.sharding, learner.params)
    # The guard catches a device-to-host copy on an accelerator (on CPU the host reads device
    # memory in place and it sees none: there the array type below is what tells).
    guard = "disallow" if on_device else "allow"
    with jax.transfer_guard_device_to_host(guard), compiled_functions() as names:
      learner.publish_to(store, version, dtypes=dtypes, on_device=on_device)
    copies_compiled.append(names.count("jit(_compiled_copy)"))
    learner.update(random_batch(rng))  # donates the parameters the copy was made from
    _, published = store.pull(version - 1)
    for got, want, sharding in zip(
      *(jax.tree.leaves(t) for t in (published, before, shardings)), strict=True
    ):
      assert isinstance(got, jax.Array) == on_device
      assert not on_device or got.sharding.is_equivalent_to(sharding, got.ndim)
      assert not on_device or not got.is_deleted()
      assert got.dtype == np.dtype(dtype or want.dtype)
      np.testing.assert_array_equal(np.asarray(got), want.astype(got.dtype))
  # Counted by compile events, not by the jit cache's size, which another test's leftover
  # thread or a cache clear elsewhere in the process can change.
  # (The first may find its program compiled by an earlier test of this process.)
  assert copies_compiled[0] <= 1 and copies_compiled[1] == 0  # the second compiled nothing


def test_batch_lengths_are_the_lengths_pad_sequences_can_give():
  rng = np.random.default_rng()
  shortest, longest, max_new = 5, 13, 9
  lengths = batch_lengths(shortest, longest, max_new)
  assert lengths == [8, 16, 24]
  for _ in range(50):
    n = int(rng.integers(1, 6))
    prompts = [[3] * int(rng.integers(shortest, longest + 1)) for _ in range(n)]
    responses = [[4] * int(rng.integers(1, max_new + 1)) for _ in range(n)]
    assert pad_sequences(prompts, responses, 0)[0].shape[1] in lengths


@pytest.mark.parametrize("axes", [{"fsdp": 4}, {"fsdp": 2, "tensor": 2}])
def test_fsdp_gathers_weights_not_activations(axes):
  """The residual stream stays split by rows between blocks (`Learner.activation_sharding`):
  a packed micro-step's collectives carry weights and gradients, and activations only within
  an fsdp shard's rows (tensor parallelism's all-reduces). Left to XLA, the fsdp mesh's
  micro-step gathered and all-reduced whole `[rows, positions, ...]` activations instead."""
  rows, length = 8, 40  # no parameter of the tiny model has a dimension of 40
  learner = Learner(
    MODEL,
    make_mesh(jax.devices()[4:], axes),
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(),
    updates_per_step=1,
    micro_batch_size=rows,
    temperature=1.0,
    pack_length=length,
    abstract=True,
  )
  micro_step = update_plan.compiled_update(learner, rows, length + 1)[0]
  collectives = update_plan.collective_results(micro_step.as_text())
  kinds = {c.kind for c in collectives}
  assert {"all-gather", "all-reduce"} <= kinds  # weights gathered, gradients summed
  with_positions = [c for c in collectives for shape in c.shapes if length in shape]
  if "tensor" not in axes:
    assert not with_positions
  else:  # [rows on this fsdp shard, positions, ...]
    assert with_positions
    assert all(shape[0] == rows // axes["fsdp"] for c in with_positions for shape in c.shapes)


def test_collective_results_read_combined_and_asynchronous_collectives():
  """HLO as XLA:CPU and a GPU compile write it: a combined all-reduce gives several shapes, an
  asynchronous pair counts once (at its `-done`), other ops none."""
  hlo = """
  %all-reduce.28 = (f32[2,32,128]{2,1,0}, bf16[128]{0}) all-reduce(%a, %b), replica_groups={}
  %all-gather.3 = f32[128,384]{1,0} all-gather(f32[32,384]{1,0} %x), dimensions={0}
  %ag-start = (f32[32,384]{1,0}, f32[128,384]{1,0}) all-gather-start(f32[32,384]{1,0} %x)
  %ag-done = f32[128,384]{1,0} all-gather-done((f32[32,384]{1,0}, f32[128,384]{1,0}) %ag-start)
  %fusion.1 = f32[128,384]{1,0} fusion(f32[128,384]{1,0} %all-gather.3), kind=kLoop
  %rs = s8[16]{0} reduce-scatter(s8[64]{0} %y), dimensions={0}
  """
  results = update_plan.collective_results(hlo)
  assert [(c.kind, c.shapes, c.bytes) for c in results] == [
    ("all-reduce", ((2, 32, 128), (128,)), 2 * 32 * 128 * 4 + 128 * 2),
    ("all-gather", ((128, 384),), 128 * 384 * 4),
    ("all-gather", ((128, 384),), 128 * 384 * 4),
    ("reduce-scatter", ((16,),), 16),
  ]


def test_collectives_racing_loops_are_those_after_a_loop_of_collectives_they_do_not_wait_for():
  """A collective after a loop that holds a collective (in its body, or in a computation the
  body calls) races it unless it depends on the loop's result, at the top level as in a loop's
  body; one before the loop, or after a loop without collectives, does not."""
  hlo = """
%inner (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %sum = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%p), index=1
  %c = f32[4]{0} call(%v), to_apply=%inner
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %c)
}

%quiet_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %v)
}

%outer_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %inner_loop = (s32[], f32[4]{0}) while(%p), condition=%cond, body=%body
  %inner_out = f32[4]{0} get-tuple-element(%inner_loop), index=1
  %waits_in_body = f32[4]{0} all-reduce(%inner_out), replica_groups={}, to_apply=%add
  %races_in_body = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %waits_in_body)
}

ENTRY %main (a: f32[4], w: f32[2]) -> f32[8] {
  %a = f32[4]{0} parameter(0)
  %w = f32[2]{0} parameter(1)
  %before = f32[8]{0} all-gather(%w), dimensions={0}
  %quiet = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%quiet_body
  %after_quiet = f32[8]{0} all-gather(%before), dimensions={0}
  %init = (s32[], f32[4]{0}) tuple(%zero, %a)
  %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %out = f32[4]{0} get-tuple-element(%loop), index=1
  %waits = f32[4]{0} all-reduce(%out), replica_groups={}, to_apply=%add
  %races = f32[8]{0} all-gather(%w), dimensions={0}, metadata={op_name="%loop"}
  %nested = (s32[], f32[4]{0}) while(%loop), condition=%cond, body=%outer_body
  %nested_out = f32[4]{0} get-tuple-element(%nested), index=1
  ROOT %waits_too = f32[8]{0} all-gather(%nested_out), dimensions={0}
}
"""
  assert update_plan.collectives_racing_loops(hlo) == ["races", "races_in_body"]


@pytest.mark.parametrize(
  ("axes", "pack", "kl"),
  [({"fsdp": 2, "tensor": 2}, 24, 0.1), ({"fsdp": 4}, 24, 0.0), ({"fsdp": 4}, 0, 0.0)],
)
def test_a_learner_on_cpu_devices_that_exchange_data_runs_no_collective_racing_a_loop(
  monkeypatch, axes, pack, kl
):
  """On fsdp or tensor-parallel CPU meshes the learner runs the blocks unrolled
  (`scan_fit.exchanges_on_cpu`), and its programs have no collective that XLA:CPU may run out
  of order across devices (`update_plan.collectives_racing_loops`). Scanned, the packed
  micro-step has some (the LM head's all-gathers after the loop over the blocks, metrics'
  all-reduces after the backward loop), and so has the padded update inside its loop over
  micro-batches; data-parallel, the learner keeps the scan."""

  def learner(mesh_axes):
    return Learner(
      MODEL,
      make_mesh(jax.devices()[4:], mesh_axes),
      TRAIN_RULES,
      loss=LossConfig(kl_weight=kl),
      optimizer=OptimizerConfig(),
      updates_per_step=1,
      micro_batch_size=4,
      temperature=1.0,
      pack_length=pack,
      abstract=True,
    )

  unrolled = learner(axes)
  assert not unrolled.model.config.scan_layers
  for program in update_plan.compiled_update(unrolled, 16, 25):
    assert update_plan.collectives_racing_loops(program.as_text()) == []
  assert learner({"data": 4}).model.config.scan_layers
  monkeypatch.setattr(scan_fit, "exchanges_on_cpu", lambda mesh: False)
  scanned = learner(axes)
  assert scanned.model.config.scan_layers
  first = update_plan.compiled_update(scanned, 16, 25)[0]  # packed: the micro-step
  assert update_plan.collectives_racing_loops(first.as_text())


@pytest.mark.parametrize("pack_length", [24, 0], ids=["packed", "padded"])
def test_data_parallel_replicas_sum_their_gradients_apart_until_the_update(pack_length):
  """On a data-parallel mesh each replica adds its micro-batches' gradients into its own sums
  (`replica_sums`): packed, the micro-step moves nothing between devices and the apply step
  all-reduces once; padded, the update program all-reduces once, after its scan over the
  micro-batches, not in it. The update is the one a single device makes from the batch."""
  rng = np.random.default_rng(5)
  batch = random_batch(rng, size=32)
  params = MODEL.init(int(rng.integers(1 << 16)))

  def learner(devices, axes):
    return Learner(
      MODEL,
      make_mesh(jax.devices()[devices], axes),
      TRAIN_RULES,
      loss=LossConfig(),
      optimizer=OptimizerConfig(learning_rate=1e-3, eps=1.0),
      updates_per_step=1,
      micro_batch_size=8,  # 4 micro-batches an update
      temperature=1.0,
      params=params,
      pack_length=pack_length,
    )

  replicas, one = learner(slice(4, 8), {"data": 4}), learner(slice(1, 2), {})
  programs = update_plan.compiled_update(replicas, 32, 24)
  if pack_length:
    micro_step, apply_step = programs
    assert update_plan.collective_results(micro_step.as_text()) == []
    reduced = update_plan.collective_results(apply_step.as_text())
  else:
    text = programs[0].as_text()
    reduced = update_plan.collective_results(text)
    assert reduced == update_plan.collective_results(update_plan.entry_computation(text))
  assert {c.kind for c in reduced} == {"all-reduce"}
  gradient_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert gradient_bytes <= sum(c.bytes for c in reduced) < 2 * gradient_bytes
  scale = loss_scale(one, batch)
  got, want = replicas.update(batch), one.update(batch)
  terms = tolerance.model_terms(MODEL.config, tokens=batch.mask_bt.size)
  tolerance.assert_close(got["loss"], want["loss"], n=terms, scale=scale, err_msg="loss")
  for key in ("grad_norm", "clip_frac", "ratio_mean", "entropy"):
    assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-4), key
  terms = tolerance.update_terms(MODEL.config, params, batch.mask_bt.size)
  tolerance.assert_same_update(replicas.params, one.params, params, n=terms)
