"""Sequence packing: the layout, and packed against padded losses, gradients and updates."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.kernels.flash_attention import CUDNN_MAX_SEGMENTS, cudnn
from jaxrl.model import Model, get_preset
from jaxrl.rl.experience import pad_sequences
from jaxrl.sharding import TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, MicroBatch, OptimizerConfig, TrainBatch, policy_loss
from jaxrl.train.packing import (
  auto_pack_length,
  first_fit_decreasing,
  pack_batch,
  pack_layout,
  row_length,
  sequence_lengths,
)
from jaxrl.train.routing import MoEConfig

# Every aggregation, ratio level and behaviour correction, each with and without KL.
LOSSES = {
  "token-mean": LossConfig(),
  "seq-mean-kl": LossConfig(aggregation="seq-mean-token-mean", kl_weight=0.3),
  "gspo": LossConfig(
    aggregation="seq-mean-token-mean", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4
  ),
  "truncate-token-kl": LossConfig(
    proximal="recompute", behaviour_correction="truncate", behaviour_cap=1.2, kl_weight=0.1
  ),
  "mask-sequence": LossConfig(
    aggregation="seq-mean-token-mean",
    proximal="recompute",
    behaviour_correction="mask",
    behaviour_level="sequence",
    behaviour_cap=1.5,
  ),
}


def random_padded(rng, size=12, length=24, prompt=(2, 8), response=(1, 12)):
  prompts = [list(rng.integers(3, 60, rng.integers(*prompt))) for _ in range(size)]
  responses = [list(rng.integers(3, 60, rng.integers(*response))) for _ in range(size)]
  tokens, mask = pad_sequences(prompts, responses, 0, length=length)
  mask[rng.integers(size)] = 0.0  # a sequence with nothing to train on is left out
  old = np.where(mask > 0, rng.normal(-3.0, 0.5, mask.shape), 0.0).astype(np.float32)
  return TrainBatch(tokens, mask, old, rng.normal(size=size).astype(np.float32))


def test_first_fit_decreasing_fills_rows_without_overlap():
  rng = np.random.default_rng()
  capacity = 32
  lengths = rng.integers(0, capacity + 1, 200)
  row, offset = first_fit_decreasing(lengths, capacity)
  assert (row[lengths == 0] == -1).all() and (row[lengths > 0] >= 0).all()
  rows = row.max() + 1
  for r in range(rows):
    members = np.flatnonzero(row == r)
    spans = sorted((offset[i], offset[i] + lengths[i]) for i in members)
    assert spans[0][0] == 0 and spans[-1][1] <= capacity
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # end to end
  # First-fit decreasing needs at most 11/9 of the fewest rows, plus one.
  assert rows <= 11 / 9 * np.ceil(lengths.sum() / capacity) + 1
  with pytest.raises(ValueError, match="train.pack_length"):
    first_fit_decreasing(np.array([3, 33]), capacity)


def test_rows_hold_at_most_max_segments_and_cudnn_takes_every_one():
  """With `max_segments` (the learner's, under `model.attention="cudnn"`) no row holds more
  sequences than cuDNN's packed layout has slots, so cuDNN, not the Pallas fallback, runs every
  micro-batch; without it, short sequences crowd rows past that."""
  rng = np.random.default_rng()
  lengths = rng.integers(1, 9, 300)
  row, _ = first_fit_decreasing(lengths, 128, max_per_row=5)
  assert np.bincount(row).max() == 5
  assert np.bincount(first_fit_decreasing(lengths, 128)[0]).max() > 5
  with pytest.raises(ValueError, match="max_per_row"):
    first_fit_decreasing(lengths, 128, max_per_row=0)
  batch = random_padded(rng, size=40, response=(1, 4))
  layout = pack_layout(batch.mask_bt, 256, rows=2, max_segments=CUDNN_MAX_SEGMENTS)
  seg = layout.segment_ids_mbp.reshape(-1, 256)
  pos = layout.positions_mbp.reshape(-1, 256)
  assert seg.max() + 1 == CUDNN_MAX_SEGMENTS  # the cap binds here
  cudnn_layout = cudnn.packed_layout(
    jnp.asarray(seg), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(pos),
    max_segments=CUDNN_MAX_SEGMENTS, causal=True,
  )  # fmt: skip
  assert bool(cudnn_layout.servable)
  crowded = pack_layout(batch.mask_bt, 256, rows=2).segment_ids_mbp
  assert crowded.max() + 1 > CUDNN_MAX_SEGMENTS


def test_a_cudnn_learner_packs_at_most_cudnn_max_segments_a_row():
  """The learner of a `model.attention="cudnn"` model caps its rows' sequences (host side
  only: nothing here runs cuDNN); another learner does not."""
  rng = np.random.default_rng()
  batch = random_padded(rng, size=40, response=(1, 4))
  behaviour = batch.old_logp_bt
  cfg = get_preset("tiny", max_seq_len=40, dtype="bfloat16", attention="cudnn")
  segments = {}
  for attention in ("cudnn", "flash"):
    model = Model(dataclasses.replace(cfg, attention=attention))
    learner = make_learner(model, 256, LossConfig(), abstract=True)
    _, packed = learner._pack(batch, behaviour)
    segments[attention] = int(packed.segment_ids_bt.max()) + 1
  assert segments["cudnn"] == CUDNN_MAX_SEGMENTS < segments["flash"]


def test_layout_restarts_positions_per_segment_and_round_trips():
  rng = np.random.default_rng()
  batch = random_padded(rng, size=20)
  layout = pack_layout(batch.mask_bt, 24, rows=4)
  lengths = sequence_lengths(batch.mask_bt)
  m, b, p = layout.shape
  assert b == 4 and p == 24 and m * b * p >= lengths.sum()
  packed = pack_batch(
    layout, batch.tokens_bt, batch.mask_bt, batch.old_logp_bt, batch.old_logp_bt,
    batch.advantages_b,
  )  # fmt: skip
  # Every trained target, once, with its log-prob and its sequence's advantage.
  assert packed.mask_bt.sum() == batch.mask_bt.sum()
  np.testing.assert_array_equal(layout.scatter(packed.old_logp_bt), batch.old_logp_bt)
  np.testing.assert_array_equal(
    layout.scatter(packed.targets_bt), np.where(np.arange(23) < lengths[:, None],
                                                batch.tokens_bt[:, 1:], 0)
  )  # fmt: skip
  for row in range(m * b):
    seg, pos = packed.segment_ids_bt.reshape(-1, p)[row], packed.positions_bt.reshape(-1, p)[row]
    ids = seg[seg >= 0]
    assert (np.diff(ids) >= 0).all() and (ids[0] == 0 if ids.size else True)
    assert (np.diff(ids) <= 1).all()
    padding = np.flatnonzero(seg == -1)
    assert (seg[padding[0] if padding.size else p :] == -1).all()  # padding only at the end
    for s in np.unique(ids):  # positions 0, 1, ... within each segment, inputs in order
      assert (pos[seg == s] == np.arange((seg == s).sum())).all()
  assert (packed.mask_bt[packed.segment_ids_bt < 0] == 0).all()
  adv = packed.advantages[packed.mask_bt > 0]
  assert set(adv) <= set(batch.advantages_b)


def test_row_lengths_and_settings():
  assert auto_pack_length(64, 8, 13) == 24  # 13 + 8 tokens, 20 positions, rounded up to 8
  assert auto_pack_length(64, 60, 13) == 64  # capped by max_seq_len
  assert auto_pack_length(2048, 1024, None) == 2048
  assert row_length(20, 24) == 24 and row_length(25, 24) == 32 and row_length(100, 64) == 112
  with pytest.raises(ValueError, match="pack_length"):
    pack_layout(np.ones((2, 4)), 0, 2)


def _packed_loss(micro_mbt, logp_mbt, ref_mbt, cfg, num_tokens, num_seqs):
  total, metrics = 0.0, {}
  for i in range(micro_mbt.mask_bt.shape[0]):
    loss, m = policy_loss(
      logp_mbt[i], micro_mbt.old_logp_bt[i], micro_mbt.advantages[i], micro_mbt.mask_bt[i], cfg,
      num_tokens=num_tokens, num_seqs=num_seqs, ref_logp_bt=ref_mbt[i],
      behaviour_logp_bt=micro_mbt.behaviour_logp_bt[i], segment_ids_bt=micro_mbt.segment_ids_bt[i],
    )  # fmt: skip
    total = total + loss
    metrics = {k: metrics.get(k, 0.0) + v for k, v in m.items()}
  return total, metrics


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_packed_policy_loss_and_gradient_equal_the_padded_ones(name):
  """The loss alone (no model): every normalisation and metric over packed segments equals the
  padded rows', and so does the gradient with respect to the log-probs."""
  cfg = LOSSES[name]
  rng = np.random.default_rng()
  batch = random_padded(rng, size=16)
  mask = batch.mask_bt
  logp = np.where(mask > 0, batch.old_logp_bt + rng.normal(0, 0.2, mask.shape), 0.0)
  ref = np.where(mask > 0, batch.old_logp_bt + rng.normal(0, 0.2, mask.shape), 0.0)
  behaviour = np.where(mask > 0, batch.old_logp_bt + rng.normal(0, 0.3, mask.shape), 0.0)
  logp, ref, behaviour = (x.astype(np.float32) for x in (logp, ref, behaviour))
  num_tokens, num_seqs = float(mask.sum()), float(batch.size)

  def padded(lp):
    return policy_loss(
      lp, batch.old_logp_bt, batch.advantages_b, mask, cfg, num_tokens=num_tokens,
      num_seqs=num_seqs, ref_logp_bt=ref, behaviour_logp_bt=behaviour,
    )  # fmt: skip

  layout = pack_layout(mask, 40, rows=2)
  assert layout.num_micro_batches >= 2
  micro = pack_batch(
    layout, batch.tokens_bt, mask, batch.old_logp_bt, behaviour, batch.advantages_b
  )
  micro = jax.tree.map(jnp.asarray, micro)

  def gather(x_bt):  # `PackLayout.gather` in jnp, so that the gradient flows through it
    flat = jnp.zeros(int(np.prod(layout.shape)), jnp.float32)
    return flat.at[layout.dest].set(jnp.ravel(x_bt)[layout.src]).reshape(layout.shape)

  def packed(lp):
    return _packed_loss(micro, gather(lp), gather(ref), cfg, num_tokens, num_seqs)

  (want, want_m), want_g = jax.value_and_grad(padded, has_aux=True)(jnp.asarray(logp))
  (got, got_m), got_g = jax.value_and_grad(packed, has_aux=True)(jnp.asarray(logp))
  n = int(mask.sum())
  scale = tolerance.policy_loss_scale(
    logp, batch.old_logp_bt, batch.advantages_b, mask, ref_logp_bt=ref, kl_weight=cfg.kl_weight
  )
  tolerance.assert_close(got, want, n=n, scale=scale, err_msg="loss")
  assert set(got_m) == set(want_m)
  for key in want_m:
    tolerance.assert_close(got_m[key], want_m[key], n=n, scale=max(scale, 1.0), err_msg=key)
  tolerance.assert_close(got_g, want_g, n=n, scale=scale, err_msg="gradient")
  assert float(want_m["behaviour_adjusted_frac"]) > 0 or cfg.behaviour_correction == "none"


MODELS = {
  "dense": Model(get_preset("tiny", max_seq_len=40)),
  "moe-replay": Model(get_preset("tiny-moe", num_layers=2, max_seq_len=40)),
}


def make_learner(
  model, pack, loss, *, params=None, devices=1, updates=1, micro=4, moe=None, abstract=False
):
  # Not device 0, where `params` are made: an update donates the learner's buffers, and a
  # device_put onto the device they are on may keep them rather than copy.
  return Learner(
    model,
    make_mesh(jax.devices()[4 : 4 + devices], {"fsdp": devices}),
    TRAIN_RULES,
    loss=loss,
    optimizer=OptimizerConfig(learning_rate=1e-3, eps=1.0),
    updates_per_step=updates,
    micro_batch_size=micro,
    temperature=0.9,
    params=params,
    moe=moe,
    pack_length=pack,
    abstract=abstract,
  )


# The model-level check of seq-mean-kl is `slow` (its loss-level check above runs by default).
@pytest.mark.parametrize(
  "name",
  [
    "token-mean",
    pytest.param("seq-mean-kl", marks=pytest.mark.slow),
    # The loss alone, packed against padded, is tested for every loss by default (above).
    pytest.param("gspo", marks=pytest.mark.slow),
  ],
)
def test_packed_model_loss_and_gradients_equal_the_padded_ones(name):
  """fp32, through the model: the loss, metrics and gradients of a packed batch (attention
  kept within segments, positions reset) are the padded batch's, to float32 rounding. The MoE
  model replays random routes, which packing carries along with their tokens."""
  model = MODELS["moe-replay" if name == "gspo" else "dense"]
  cfg = model.config
  loss_cfg = LOSSES[name]
  rng = np.random.default_rng()
  batch = random_padded(rng, size=8, length=24)
  moe = None
  if cfg.is_moe:
    routes = rng.integers(0, cfg.num_experts, (8, 23, cfg.num_layers, cfg.experts_per_token))
    batch.routes_btlk = routes.astype(np.int32)
    moe = MoEConfig(routing_replay=True)
  params = model.init(int(rng.integers(1 << 16)))
  ref_params = jax.tree.map(lambda x: x + 0.02 * rng.normal(size=x.shape).astype(x.dtype), params)
  learner = make_learner(model, 32, loss_cfg, params=params, moe=moe, micro=1)
  behaviour = np.where(batch.mask_bt > 0, batch.old_logp_bt + rng.normal(0, 0.3, (8, 23)), 0.0)
  behaviour = behaviour.astype(np.float32)
  routes = learner._replayed_routes(batch)
  num_tokens, num_seqs = np.float32(batch.mask_bt.sum()), np.float32(batch.size)

  def grads_of(micro):
    fn = jax.value_and_grad(learner._programs.micro_loss, has_aux=True)
    return jax.jit(fn)(params, ref_params, micro, num_tokens, num_seqs, None)

  padded = MicroBatch(
    batch.tokens_bt[:, :-1], batch.tokens_bt[:, 1:], batch.mask_bt, batch.old_logp_bt, behaviour,
    batch.advantages_b, routes_btlk=routes,
  )  # fmt: skip
  (want, want_m), want_g = grads_of(padded)
  layout, packed = learner._pack(dataclasses.replace(batch, routes_btlk=routes), behaviour)
  assert layout.num_micro_batches >= 2  # gradients are summed over packed micro-batches
  got, got_m, got_g = 0.0, {}, jax.tree.map(jnp.zeros_like, params)
  for i in range(layout.num_micro_batches):
    (loss, m), g = grads_of(jax.tree.map(lambda x, i=i: x[i], packed))
    got, got_g = got + loss, jax.tree.map(jnp.add, got_g, g)
    got_m = {k: got_m.get(k, 0.0) + v for k, v in m.items()}

  tokens = int(batch.mask_bt.size)
  logp_bt = learner.logprobs(params, batch.tokens_bt, routes)
  scale = tolerance.policy_loss_scale(
    logp_bt, batch.old_logp_bt, batch.advantages_b, batch.mask_bt, computed_logp=True,
    ref_logp_bt=learner.logprobs(ref_params, batch.tokens_bt, routes),
    kl_weight=loss_cfg.kl_weight,
  )  # fmt: skip
  terms = tolerance.model_terms(cfg, tokens=tokens)
  tolerance.assert_close(got, want, n=terms, scale=scale, err_msg="loss")
  for key in want_m:
    tolerance.assert_close(got_m[key], want_m[key], n=terms, scale=max(scale, 1.0), err_msg=key)
  terms = tolerance.model_terms(cfg, backward=True, tokens=tokens)
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g), strict=True
  ):
    w = np.asarray(w)
    tolerance.assert_close(g, w, n=terms, scale=np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


# `slow` (52 s of a full run): packed loss and gradients equal padded ones, and the packed
# precompile covers what updates meet, in the default tests above and below.
@pytest.mark.slow
def test_packed_learner_updates_like_the_padded_one_and_compiles_once(caplog):
  """Two optimizer updates per step with KL and decoupled PPO (proximal log-probs recomputed
  on packed rows), on a 2-device mesh: the packed learner's parameters and metrics are the
  padded learner's. Then batches of other lengths meet the same compiled shapes, except one
  with a sequence longer than the rows, which is logged and gets rows of its own."""
  model = MODELS["dense"]
  rng = np.random.default_rng()
  params = model.init(int(rng.integers(1 << 16)))
  loss = LOSSES["truncate-token-kl"]
  padded = make_learner(model, 0, loss, params=params, devices=2, updates=2)
  packed = make_learner(model, 32, loss, params=params, devices=2, updates=2)
  batch = random_padded(rng, size=16, length=24)
  logp = padded.logprobs(params, batch.tokens_bt)
  tolerance.assert_close(
    packed.proximal_logprobs(batch), padded.proximal_logprobs(batch),
    n=tolerance.model_terms(model.config), scale=np.abs(np.asarray(logp)).max(),
  )  # fmt: skip
  want, got = jax.device_get(padded.update(batch)), jax.device_get(packed.update(batch))
  assert set(got) == set(want) and got["skipped"] == 0
  scale = tolerance.policy_loss_scale(
    logp, batch.old_logp_bt, batch.advantages_b, batch.mask_bt, computed_logp=True
  )
  terms = tolerance.model_terms(model.config, tokens=batch.mask_bt.size)
  tolerance.assert_close(got["loss"], want["loss"], n=terms, scale=scale, err_msg="loss")
  for key in ("grad_norm", "entropy", "ratio_mean", "behaviour_weight_mean", "behaviour_ess"):
    assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-4), key
  # The second update's gradient is taken at the first's parameters: rounding compounds.
  terms = 2 * tolerance.update_terms(model.config, params, batch.mask_bt.size)
  tolerance.assert_same_update(packed.params, padded.params, params, n=terms)

  def sizes():
    return (
      packed.compiled_shapes("micro_step"),
      packed.compiled_shapes("apply"),
      packed.compiled_shapes("packed_logprobs"),
    )

  assert sizes() == (1, 1, 1)
  for length, response in ((16, (1, 6)), (40, (10, 25)), (32, (1, 20))):
    packed.update(random_padded(rng, size=16, length=length, response=response))
  assert sizes() == (1, 1, 1)
  long = random_padded(rng, size=16, length=40, response=(1, 4))
  long.mask_bt[3, :36] = 1.0  # 36 positions: past the rows' 32
  with caplog.at_level(logging.WARNING, logger="jaxrl.train.learner"):
    packed.update(long)
  assert "Raise train.pack_length to at least 36" in caplog.text
  assert sizes() == (2, 1, 2)


def test_packed_precompile_trains_nothing_and_compiles_what_updates_meet():
  model = MODELS["dense"]
  rng = np.random.default_rng()
  learner = make_learner(model, 24, LossConfig(proximal="recompute"), devices=2, updates=2)
  before = jax.device_get((learner.params, learner.opt_state))
  assert learner.precompile(16, [16, 24, 32]) == 2  # rows of 24, and of 32 for length 32
  after = jax.device_get((learner.params, learner.opt_state))
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(x, y)
  compiled = (learner.compiled_shapes("micro_step"), learner.compiled_shapes("apply"))
  assert compiled == (2, 1)
  for length in (8, 16, 24):
    batch = random_padded(rng, size=16, length=length, prompt=(2, 5), response=(1, length - 4))
    metrics = jax.device_get(learner.update(batch))
    assert metrics["skipped"] == 0
  assert (learner.compiled_shapes("micro_step"), learner.compiled_shapes("apply")) == compiled
  plan = learner.update_memory(16, 24)
  assert plan["arguments_gib"] > 0 and plan["temporaries_gib"] > 0


# Padded (packing off) is `slow`: the abstract build does not depend on packing, and the
# padded path's plan differs only in the shapes it compiles.
@pytest.mark.parametrize("pack", [pytest.param(0, marks=pytest.mark.slow), 24])
def test_abstract_learner_plans_what_the_real_one_does(pack):
  """`abstract=True`: shapes on the mesh's shardings, nothing allocated, the same buffer plan
  (the planning a TPU or GPU topology gets from a CPU machine, `launch/bench_kernels.py`)."""
  model, loss = MODELS["dense"], LossConfig(kl_weight=0.1)  # with a reference copy
  real = make_learner(model, pack, loss, devices=2)
  abstract = make_learner(model, pack, loss, devices=2, abstract=True)
  for tree in (abstract.params, abstract.opt_state, abstract.ref_params):
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))
  shardings = [x.sharding for x in jax.tree.leaves(real.params)]
  assert [x.sharding for x in jax.tree.leaves(abstract.params)] == shardings
  assert abstract.update_memory(16, 24) == real.update_memory(16, 24)
  with pytest.raises(ValueError, match="pass params=None"):
    make_learner(model, pack, loss, params=real.params, abstract=True)


def test_bad_packing_inputs():
  model = MODELS["dense"]
  with pytest.raises(ValueError, match="pack_length must be 0"):
    make_learner(model, -1, LossConfig())
  mask = np.ones((2, 5), np.float32)
  with pytest.raises(ValueError, match="advantages_b and segment_ids_bt must be"):
    policy_loss(
      jnp.zeros((2, 5)), jnp.zeros((2, 5)), jnp.zeros(2), mask, LossConfig(), num_tokens=10,
      num_seqs=2, segment_ids_bt=jnp.ones((2, 5), jnp.int32),
    )  # fmt: skip
