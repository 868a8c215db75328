"""MoE training: routing replay from the paged engine's trace, micro-batch placements, and the
expert-parallel learner against the reference-dispatch learner."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import Model, get_preset
from jaxrl.rl.experience import build_batch
from jaxrl.rollout import PagedConfig, PagedEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, MoEConfig, OptimizerConfig, TrainBatch
from jaxrl.train.routing import expert_loads, fill_padding, routes_from_completions

MODEL = Model(get_preset("tiny-moe", num_layers=2))
REPLAY = MoEConfig(routing_replay=True, placement="least_loaded", redundant_slots=1)


def learner(axes, params, moe=REPLAY, micro=8, pack=0, model=MODEL):
  mesh = make_mesh(jax.devices()[4:], axes)
  return Learner(
    model,
    mesh,
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(learning_rate=1e-3, eps=1.0),
    updates_per_step=1,
    micro_batch_size=micro,
    temperature=1.0,
    params=params,
    moe=moe,
    pack_length=pack,
  )


@pytest.fixture(scope="module")
def rollout():
  """Completions of the MoE model from a paged engine that itself runs expert-parallel."""
  rng = np.random.default_rng()
  params = MODEL.init(int(rng.integers(1 << 16)))
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "expert": 2})
  engine = PagedEngine(
    MODEL, mesh, ROLLOUT_RULES, eos_id=2, pad_id=0,
    config=PagedConfig(page_size=8, num_pages=64, max_running=16, decode_steps=4),
  )  # fmt: skip
  engine.update_weights(params, 0)
  prompts = [list(rng.integers(3, 60, rng.integers(2, 9))) for _ in range(16)]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
  completions = engine.generate(prompts, sampling, seed=int(rng.integers(1 << 16)))
  advantages = rng.normal(size=len(completions)).astype(np.float32)
  return params, completions, build_batch(completions, advantages, pad_id=0)


def test_replayed_routes_reproduce_the_rollout_log_probs(rollout):
  params, completions, batch = rollout
  cfg = MODEL.config
  assert batch.routes_btlk.shape == (
    *batch.mask_bt.shape, cfg.num_layers, cfg.experts_per_token
  )  # fmt: skip
  for i, c in enumerate(completions):  # -1 exactly past each sequence's inputs
    n = len(c.prompt_ids) + len(c.token_ids) - 1
    assert (batch.routes_btlk[i, :n] >= 0).all() and (batch.routes_btlk[i, n:] == -1).all()
  filled = fill_padding(batch.routes_btlk, cfg.num_experts)
  assert (filled >= 0).all() and (
    np.sort(filled, -1)[..., 1:] != np.sort(filled, -1)[..., :-1]
  ).all()
  ep = learner({"fsdp": 2, "expert": 2}, params)
  with jax.default_matmul_precision("highest"):
    logp = np.asarray(ep.logprobs(ep.params, batch.tokens_bt, ep._replayed_routes(batch)))
  mask = batch.mask_bt > 0
  # The engine's log-probs, with the same experts: apart by the rounding of the model only.
  terms = tolerance.model_terms(MODEL.config)
  tolerance.assert_close(logp[mask], batch.old_logp_bt[mask], n=terms)


# Padded (packing off) is `slow`: tests/train/packing_test.py holds the two paths equal.
@pytest.mark.parametrize(
  "pack", [pytest.param(0, id="padded", marks=pytest.mark.slow), pytest.param(24, id="packed")]
)
def test_expert_parallel_learner_with_placements_matches_the_reference_learner(rollout, pack):
  """Also packed: the expert-parallel learner plans a placement per packed micro-batch from the
  routes packing carried along, and still trains as the padded reference learner."""
  params, _, batch = rollout
  with jax.default_matmul_precision("highest"):
    ep = learner({"fsdp": 2, "expert": 2}, params, pack=pack)
    ref = learner({"fsdp": 4}, params, moe=MoEConfig(routing_replay=True))
    assert ep.expert_parallel is not None and ref.expert_parallel is None
    logp_bt = ref.logprobs(ref.params, batch.tokens_bt, ref._replayed_routes(batch))
    got, want = ep.update(batch), ref.update(batch)
  mask_bt, tokens = batch.mask_bt, batch.mask_bt.size
  scale = tolerance.policy_loss_scale(
    logp_bt, batch.old_logp_bt, batch.advantages_b, mask_bt, computed_logp=True
  )
  terms = tolerance.model_terms(MODEL.config, tokens=tokens)
  tolerance.assert_close(got["loss"], want["loss"], n=terms, scale=scale, err_msg="loss")
  assert float(got["moe_imbalance_planned"]) <= float(got["moe_imbalance_static"])
  assert "moe_dropped_frac" not in got  # dropless
  terms = tolerance.update_terms(MODEL.config, params, tokens)
  tolerance.assert_same_update(ep.params, ref.params, params, n=terms)


def test_the_grouped_dispatch_learner_matches_the_reference_learner(rollout):
  """The grouped dispatch (`model.moe_dispatch="grouped"`) on an fsdp mesh, packed, with
  routing replay: the same update as the reference dispatch's; no placement is planned (one
  device's worth of experts), and asking for one is refused as on any mesh without an expert
  axis."""
  params, _, batch = rollout
  grouped = Model(dataclasses.replace(MODEL.config, moe_dispatch="grouped"))
  static = MoEConfig(routing_replay=True)
  with jax.default_matmul_precision("highest"):
    got_learner = learner({"fsdp": 4}, params, moe=static, pack=24, model=grouped)
    ref = learner({"fsdp": 4}, params, moe=static)
    assert got_learner.expert_parallel is not None and not got_learner.spreads_experts
    assert ref.expert_parallel is None
    logp_bt = ref.logprobs(ref.params, batch.tokens_bt, ref._replayed_routes(batch))
    got, want = got_learner.update(batch), ref.update(batch)
  assert "moe_imbalance_planned" not in got
  mask_bt, tokens = batch.mask_bt, batch.mask_bt.size
  scale = tolerance.policy_loss_scale(
    logp_bt, batch.old_logp_bt, batch.advantages_b, mask_bt, computed_logp=True
  )
  terms = tolerance.model_terms(MODEL.config, tokens=tokens)
  tolerance.assert_close(got["loss"], want["loss"], n=terms, scale=scale, err_msg="loss")
  terms = tolerance.update_terms(MODEL.config, params, tokens)
  tolerance.assert_same_update(got_learner.params, ref.params, params, n=terms)
  with pytest.raises(ValueError, match="expert axis"):
    learner({"fsdp": 4}, None, model=grouped)


def test_loads_and_bad_settings():
  rng = np.random.default_rng()
  routes = rng.integers(0, 8, (3, 5, 2, 2)).astype(np.int32)
  loads = expert_loads(routes, 8)
  for layer in range(2):
    np.testing.assert_array_equal(
      loads[layer], np.bincount(routes[:, :, layer].ravel(), minlength=8)
    )
  with pytest.raises(ValueError, match="routing_replay=True"):
    MoEConfig(placement="replicate_pack")
  with pytest.raises(ValueError, match="expert axis"):
    learner({"fsdp": 4}, None)
  plain = learner({"fsdp": 2, "expert": 2}, None)
  assert routes_from_completions([], 4) is None
  with pytest.raises(ValueError, match="routing trace"):
    plain.update(
      TrainBatch(
        np.ones((8, 6), np.int32), np.ones((8, 5), np.float32), np.zeros((8, 5), np.float32),
        np.ones(8, np.float32),
      )
    )  # fmt: skip


def test_a_capacity_reports_its_drops_and_ignores_right_padding(rollout):
  """With an expert capacity, padding positions take none of it: the same batch with more
  padding columns gives the same log-probs and drops the same share of assignments (2 rows a
  token shard, so the rows stay whole on their devices)."""
  params, _, whole = rollout
  batch = TrainBatch(*(None if x is None else x[:8] for x in dataclasses.astuple(whole)))
  moe = MoEConfig(routing_replay=True, capacity_factor=0.5)
  more = 7
  wider = TrainBatch(
    np.pad(batch.tokens_bt, ((0, 0), (0, more))),
    np.pad(batch.mask_bt, ((0, 0), (0, more))),
    np.pad(batch.old_logp_bt, ((0, 0), (0, more))),
    batch.advantages_b,
    np.pad(batch.routes_btlk, ((0, 0), (0, more), (0, 0), (0, 0)), constant_values=-1),
  )
  metrics, logps = [], []
  with jax.default_matmul_precision("highest"):
    for b in (batch, wider):
      ep = learner({"fsdp": 2, "expert": 2}, params, moe=moe)  # one micro-batch of 8 rows
      logps.append(
        np.asarray(ep.logprobs(ep.params, b.tokens_bt, ep._replayed_routes(b), b.mask_bt))
      )
      metrics.append(ep.update(b))
  mask = batch.mask_bt > 0
  t = mask.shape[1]
  tolerance.assert_close(
    logps[1][:, :t][mask], logps[0][mask], n=tolerance.model_terms(MODEL.config)
  )
  dropped = [float(m["moe_dropped_frac"]) for m in metrics]
  assert 0 < dropped[0] < 1
  assert dropped[1] == dropped[0]


# Packed with 2 updates a step: the proximal log-probs pack each update's rows apart, as the
# update does (they packed the whole batch at once: other micro-batches, other drops; found by
# tests/train/learner_fuzz_test.py, JAXRL_LEARNER_SEED=130 and 139).
@pytest.mark.parametrize(("pack", "updates"), [(0, 1), (24, 2)], ids=["padded", "packed-2-updates"])
def test_the_proximal_policy_is_computed_as_the_update_computes_it_under_a_capacity(
  rollout, pack, updates
):
  """Decoupled PPO recomputes the proximal log-probs with the current weights: with an expert
  capacity they must see the update's real positions and placements (the same drops), or the
  first update starts away from ratio 1. Learning rate 0: the ratio stays exactly 1."""
  params, _, whole = rollout
  batch = TrainBatch(*(None if x is None else x[: 8 * updates] for x in dataclasses.astuple(whole)))
  mesh = make_mesh(jax.devices()[4:], {"fsdp": 2, "expert": 2})
  ep = Learner(
    MODEL, mesh, TRAIN_RULES,
    loss=LossConfig(proximal="recompute", behaviour_correction="truncate"),
    optimizer=OptimizerConfig(learning_rate=0.0), updates_per_step=updates,
    micro_batch_size=8 // updates, temperature=1.0, params=params,
    moe=dataclasses.replace(REPLAY, capacity_factor=0.5), pack_length=pack,
  )  # fmt: skip
  metrics = jax.device_get(ep.update(batch))
  assert metrics["moe_dropped_frac"] > 0
  assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
  assert metrics["clip_frac"] == 0


def test_a_packed_update_with_nothing_to_train_plans_no_placement(rollout):
  """Packed, a mini-batch whose sequences have no trained target packs into no micro-batch:
  there is no placement to plan for it (planning stacked none and raised a TypeError; found by
  tests/train/learner_fuzz_test.py, JAXRL_LEARNER_SEED=100 and 145), and the step trains as the
  padded learner does, the decoupled proximal log-probs included."""
  params, _, batch = rollout
  batch = dataclasses.replace(batch, mask_bt=batch.mask_bt.copy())
  batch.mask_bt[8:] = 0.0  # the second update's rows
  loss = LossConfig(proximal="recompute", behaviour_correction="truncate")
  learners = {}
  with jax.default_matmul_precision("highest"):
    for pack in (24, 0):
      ep = Learner(
        MODEL, make_mesh(jax.devices()[4:], {"fsdp": 2, "expert": 2}), TRAIN_RULES, loss=loss,
        optimizer=OptimizerConfig(learning_rate=1e-3, eps=1.0), updates_per_step=2,
        micro_batch_size=4, temperature=1.0, params=params, moe=REPLAY, pack_length=pack,
      )  # fmt: skip
      logp_bt = ep.logprobs(ep.params, batch.tokens_bt, ep._replayed_routes(batch))
      learners[pack] = ep, jax.device_get(ep.update(batch))
  (packed, got), (padded, want) = learners[24], learners[0]
  assert got["skipped"] == want["skipped"] == 0
  assert float(got["moe_imbalance_planned"]) <= float(got["moe_imbalance_static"])
  terms = tolerance.model_terms(MODEL.config, tokens=batch.mask_bt.size)
  # Ratios against the recomputed proximal policy (about 1), behaviour weights up to their cap.
  scale = loss.behaviour_cap * tolerance.policy_loss_scale(
    logp_bt, logp_bt, batch.advantages_b, batch.mask_bt, computed_logp=True
  )
  tolerance.assert_close(got["loss"], want["loss"], n=terms, scale=scale, err_msg="loss")
  terms = 2 * tolerance.model_terms(MODEL.config, backward=True, tokens=batch.mask_bt.size)
  terms += tolerance.update_terms(MODEL.config, params, 0)
  tolerance.assert_same_update(packed.params, padded.params, params, n=terms)
