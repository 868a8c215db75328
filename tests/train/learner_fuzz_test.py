"""Random learner configurations: the packed learner trains as the padded one.

Each run draws a model (the tiny dense one, one with sliding-window layers, or the tiny MoE
one with or without routing replay, an expert capacity, expert placements, the grouped
dispatch), a training mesh (one device, or data, fsdp, tensor and, for MoE, expert axes of 2),
a policy loss (aggregation, ratio level, proximal policy, behaviour correction and level, caps,
clips, KL), the optimizer updates per step, micro-batch size and packed row length, for each
learner its log-prob chunk and how it runs the model (attention kernel, rematerialisation,
scanned layers), and a batch (ragged prompts and responses, rows with nothing to train on,
holes in the mask, zero advantages, garbage behaviour log-probs off the mask). Two learners
from the same parameters, one packing its micro-batches (`pack_length` > 0) and one padding
them (`pack_length` 0), must then compute the same proximal log-probs, the same metrics and the
same parameters after `update`, to float32 rounding (`helpers.tolerance`), and again after a
second `update` on another batch.

An expert capacity that drops assignments drops different ones for different layouts, so there
the two are not compared; each is held to what holds for any layout: with decoupled PPO and a
learning rate of 0, every update starts at ratio 1 (the proximal log-probs are computed as the
update computes them, the same drops included).

A few runs draw a setting the learner refuses instead, and check that it says which setting.

A failing run names its seed: `JAXRL_LEARNER_SEED=<seed>` replays it.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest
from helpers import tolerance

from jaxrl.model import Model, get_preset
from jaxrl.rl.experience import pad_sequences
from jaxrl.sharding import TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, MoEConfig, OptimizerConfig, TrainBatch

MODELS = {
  "dense": Model(get_preset("tiny", max_seq_len=40)),
  # Three of four layers with a window of 5 positions (packed: within each sequence).
  "window": Model(
    get_preset(
      "tiny",
      max_seq_len=40,
      num_layers=4,
      sliding_window=5,
      sliding_layers=(0, 1, 3),
      local_rope_theta=100.0,
    )
  ),  # fmt: skip
  "moe": Model(get_preset("tiny-moe", num_layers=2, max_seq_len=40)),
  "moe-grouped": Model(
    get_preset("tiny-moe", num_layers=2, max_seq_len=40, moe_dispatch="grouped")
  ),
}
# How a learner runs the model, drawn for each of the two: the same weights, the same results.
EXECUTIONS = [
  dict(attention="dense"),
  dict(attention="flash"),
  dict(scan_layers=False),
  dict(remat=True, remat_policy="full"),
  dict(attention="flash", remat=True, remat_policy="save_attention"),
  dict(remat=True, remat_policy="save_dots", scan_layers=False),
]
DENSE_MESHES = [{}, {"data": 2}, {"fsdp": 2}, {"tensor": 2}, {"data": 2, "fsdp": 2},
                {"fsdp": 2, "tensor": 2}]  # fmt: skip
MESHES = {
  "dense": DENSE_MESHES,
  "window": DENSE_MESHES,
  # Expert-parallel meshes twice as often: placements, capacities, their exchange.
  "moe": [{}, {"data": 2}, {"fsdp": 2}, {"tensor": 2}, {"expert": 2}, {"fsdp": 2, "expert": 2},
          {"data": 2, "expert": 2}, {"tensor": 2, "expert": 2}, {"expert": 2},
          {"fsdp": 2, "expert": 2}, {"data": 2, "expert": 2},
          {"fsdp": 2, "tensor": 2, "expert": 2}],
  "moe-grouped": [{}, {"fsdp": 2}, {"data": 2}],
}  # fmt: skip
LONGEST = 33  # tokens of the longest batch row (prompt + response), within max_seq_len 40
# `tolerance.atol` refuses sums of more terms than this (their rounding could hide an error).
MOST_TERMS = int((1e-3 / (2 * tolerance.LAMBDA * tolerance.UNIT_ROUNDOFF)) ** 2)
PARAMS = {
  kind: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract_params()))
  for kind, model in MODELS.items()
}


def draw_loss(rng) -> LossConfig:
  """Any valid policy loss. No clip is 0: a ratio of exactly 1 (decoupled PPO's first update)
  would then sit on a clip bound, where rounding alone decides `clip_frac`."""
  proximal = str(rng.choice(["behaviour", "recompute"]))
  correction = "none" if proximal == "behaviour" else str(rng.choice(["none", "truncate", "mask"]))
  clip_low, clip_high = [(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4), (0.1, 0.5)][rng.integers(4)]
  return LossConfig(
    clip_low=clip_low,
    clip_high=clip_high,
    aggregation=str(rng.choice(["token-mean", "seq-mean-token-mean"])),
    kl_weight=float(rng.choice([0.0, 0.0, 0.1, 0.5])),
    ratio_level=str(rng.choice(["token", "token", "sequence"])),
    proximal=proximal,
    behaviour_correction=correction,
    behaviour_level=str(rng.choice(["token", "sequence"])),
    behaviour_cap=float(rng.choice([1.2, 2.0, 5.0])),
  )


def draw_config(rng, cheap: bool) -> dict:
  kinds = ["dense", "window", "moe", "moe", "moe-grouped"]
  kind = "dense" if cheap else str(rng.choice(kinds))
  axes = MESHES[kind][rng.integers(len(MESHES[kind]) if not cheap else 3)]
  rows_multiple = axes.get("data", 1) * axes.get("fsdp", 1)
  updates = int(rng.integers(1, 3 if cheap else 4))
  micro = rows_multiple * int(rng.choice([1, 2, 3] if rows_multiple == 1 else [1, 2]))
  micro_batches = int(rng.integers(1, 3 if cheap else 4))  # per update
  moe = None
  if MODELS[kind].config.is_moe:
    replay = bool(rng.random() < 0.6)
    spreads = axes.get("expert", 1) > 1
    placement = "static"
    if replay and spreads:
      placement = str(rng.choice(["static", "replicate_pack", "least_loaded"]))
    # From the expert axis' size up nothing drops (`drops`), but padding is kept out of the
    # capacity; below it, assignments drop.
    capacity = float(rng.choice([0.0, 0.0, 2.0, 4.0, 0.5, 1.0]))
    moe = MoEConfig(
      routing_replay=replay,
      placement=placement,
      redundant_slots=int(rng.integers(0, 3)),
      capacity_factor=capacity,
    )
  loss = draw_loss(rng)
  length = int(rng.integers(6, LONGEST + 1))  # tokens of a batch row
  longest_needs = length - 1
  pack = int(rng.choice([4, 8, 12, 16, 24, 32, 40, -(-longest_needs // 8) * 8]))
  cfg = dict(
    kind=kind,
    axes=axes,
    updates=updates,
    micro=micro,
    batch=updates * micro * micro_batches,
    length=length,
    moe=moe,
    loss=loss,
    pack=pack,
    # (packed, padded): options that change how the model runs, not what it computes
    chunks=(int(rng.choice([1, 3, 7, 16, 128])), int(rng.choice([1, 5, 16, 128]))),
    executions=tuple(int(rng.integers(len(EXECUTIONS))) for _ in range(2)),
    temperature=float(rng.choice([1.0, 0.7, 0.0])),  # 0: greedy rollouts, scored at 1
    learning_rate=float(rng.choice([1e-3, 1e-3, 1e-3, 0.0])),
    clip_grad=bool(rng.random() < 0.5),
    sigma=float(rng.choice([0.0, 0.05, 0.3])),  # behaviour log-probs: the model's, or noisier
    second_batch=bool(rng.random() < (0.3 if cheap else 0.5)),
  )
  if drops(cfg):  # then the layouts are not compared: each is held to ratio 1 at lr 0
    cfg["learning_rate"] = 0.0
  steps = 2 if cfg["second_batch"] else 1
  if cfg["clip_grad"] and steps * update_terms(cfg, cfg["batch"] * LONGEST) > MOST_TERMS:
    cfg["clip_grad"] = False  # the global norms of the MoE model's updates: too many terms
  return cfg


def update_terms(cfg, tokens: int) -> int:
  """`n` for the parameters after a step's updates over `tokens` positions: each a forward and
  backward pass over its rows and, with gradient clipping, the global norm (a sum over every
  parameter); each later update starts where the rounding of the earlier ones left it."""
  per_update = tolerance.model_terms(MODELS[cfg["kind"]].config, backward=True, tokens=tokens)
  return cfg["updates"] * per_update + (
    cfg["updates"] * PARAMS[cfg["kind"]] if cfg["clip_grad"] else 0
  )


def random_batch(rng, cfg, model, size, length) -> TrainBatch:
  """Ragged prompts and responses (some empty), holes in some masks, a row or two with nothing
  to train on, zero advantages, routes of the rollout when it has them. Behaviour log-probs
  are filled in by `behaviour_logprobs`."""
  prompts, responses = [], []
  for _ in range(size):
    p = int(rng.integers(1, length))
    r = int(rng.integers(0, length - p + 1)) if rng.random() < 0.9 else 0
    prompts.append(list(rng.integers(3, 60, p)))
    responses.append(list(rng.integers(3, 60, r)))
  tokens, mask = pad_sequences(prompts, responses, 0, length=length)
  holes = rng.random(mask.shape) < 0.15
  holes[rng.random(size) < 0.6] = False  # a multi-turn row: tool output between turns
  mask = np.where(holes, 0.0, mask).astype(np.float32)
  if rng.random() < 0.5:
    mask[rng.integers(size)] = 0.0
  advantages = rng.normal(size=size).astype(np.float32)
  advantages[rng.random(size) < 0.2] = 0.0
  if rng.random() < 0.15:  # a group whose rewards were all the same
    advantages[:] = 0.0
  routes = None
  mcfg = model.config
  if mcfg.is_moe and cfg["moe"].routing_replay:
    shape = (size, length - 1, mcfg.num_layers, mcfg.num_experts)
    routes = np.argsort(rng.random(shape), -1)[..., : mcfg.experts_per_token].astype(np.int32)
    inputs = np.array([len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True)])
    routes[np.arange(length - 1)[None, :] >= inputs[:, None]] = -1
  old = np.zeros(mask.shape, np.float32)
  return TrainBatch(tokens, mask, old, advantages, routes)


def behaviour_logprobs(rng, cfg, logp_bt, mask_bt) -> np.ndarray:
  """The rollout's log-probs: the model's (to rounding, or noisier), and off the mask 0 or
  garbage, which the loss ignores."""
  noisy = np.asarray(logp_bt, np.float64) + cfg["sigma"] * rng.normal(size=mask_bt.shape)
  off = 0.0 if rng.random() < 0.5 else rng.normal(-5.0, 20.0, mask_bt.shape)
  return np.where(mask_bt > 0, noisy, off).astype(np.float32)


def make_learner(cfg, params, pack, chunk, execution=0) -> Learner:
  model = MODELS[cfg["kind"]]
  model = Model(dataclasses.replace(model.config, **EXECUTIONS[execution]))
  devices = int(np.prod(list(cfg["axes"].values()), dtype=int))
  # The parameters are host arrays, so every learner holds its own copy.
  devices = jax.devices()[4 : 4 + devices] if devices <= 4 else jax.devices()[:devices]
  return Learner(
    model,
    make_mesh(devices, cfg["axes"]),
    TRAIN_RULES,
    loss=cfg["loss"],
    # eps 1: Adam's first step is about lr * gradient, so the parameters show its rounding.
    optimizer=OptimizerConfig(
      learning_rate=cfg["learning_rate"], eps=1.0, max_grad_norm=1.0 if cfg["clip_grad"] else 0.0
    ),
    updates_per_step=cfg["updates"],
    micro_batch_size=cfg["micro"],
    temperature=cfg["temperature"],
    params=params,
    moe=cfg["moe"],
    logprob_chunk=chunk,
    pack_length=pack,
  )


def drops(cfg) -> bool:
  """Whether an expert capacity may drop assignments (then layouts differ in which): a device
  may send each of the e devices of the expert axis `capacity_factor * n * k / e` of its n rows'
  assignments, and sends one device up to `n * k` (a token's k experts, all on it)."""
  experts = cfg["axes"].get("expert", 1)
  return expert_parallel(cfg) and 0 < cfg["moe"].capacity_factor < experts


def expert_parallel(cfg) -> bool:
  """Whether the MoE layers run expert-parallel (`ExpertParallel.for_mesh`), the layer that
  has a capacity: on an expert axis, or the grouped dispatch without tensor parallelism."""
  grouped = cfg["kind"] == "moe-grouped" and cfg["axes"].get("tensor", 1) == 1
  return cfg["moe"] is not None and (cfg["axes"].get("expert", 1) > 1 or grouped)


def metric_scales(cfg, logp_bt, batch, ref_logp_bt) -> dict[str, float]:
  """`scale` of each metric for `tolerance.assert_close`, from the log-probs of the batch's
  targets under the parameters (`logp_bt`) and the reference (`ref_logp_bt`, or None): a term
  `exp(x)` rounds by its size times that of `x`, a difference of log-probs each of which rounds
  by its own size (`tolerance.policy_loss_scale`)."""
  loss = cfg["loss"]
  mask = batch.mask_bt > 0
  logp = np.where(mask, np.asarray(logp_bt, np.float64), 0.0)
  behaviour = np.where(mask, np.asarray(batch.old_logp_bt, np.float64), 0.0)
  old = logp if loss.proximal == "recompute" else behaviour  # the ratio's denominators
  ratio_logs = float((np.abs(logp) + np.abs(logp - old)).max(initial=0.0))
  ratio = float(np.exp(np.where(mask, logp - old, -np.inf)).max(initial=0.0))
  # Behaviour weights: proximal over behaviour, per token or a product over each sequence.
  weight_logs_bt = np.abs(logp) + np.abs(logp - behaviour)
  if loss.behaviour_level == "sequence":
    weight_logs_bt = weight_logs_bt.sum(1)
  weight_logs, cap = float(weight_logs_bt.max(initial=0.0)), 1.0
  if loss.behaviour_correction != "none":
    cap = loss.behaviour_cap
  pg = tolerance.policy_loss_scale(
    logp_bt, old, batch.advantages_b, batch.mask_bt, ref_logp_bt=ref_logp_bt,
    kl_weight=loss.kl_weight, computed_logp=True,
  )  # fmt: skip
  pg *= cap * (1 + weight_logs) if loss.behaviour_correction != "none" else 1.0
  kl = 0.0
  if ref_logp_bt is not None:
    r = np.where(mask, np.asarray(ref_logp_bt, np.float64), 0.0) - logp
    kl = float(((np.exp(r) + np.abs(r) + 1) * (1 + np.abs(r) + np.abs(logp)))[mask].max(initial=0))
  weights = cap**2 * (1 + 2 * weight_logs)
  return {
    "loss": pg,
    "pg_loss": pg,
    "kl_penalty": pg,
    "kl": kl,
    "ratio_mean": ratio * (1 + ratio_logs),
    "behaviour_weight_mean": weights,
    "behaviour_weight_sq_mean": weights,
    "behaviour_ess": weights,
    "entropy": float(np.abs(logp).max(initial=0.0)),
  }


# Metrics of the layout, not of the update: a placement is planned per micro-batch.
LAYOUT_METRICS = ("moe_imbalance_static", "moe_imbalance_planned")


def check_same_update(cfg, got, want, batch, logp_bt, ref_logp_bt, terms) -> None:
  got, want = jax.device_get(got), jax.device_get(want)
  assert set(got) - set(LAYOUT_METRICS) == set(want) - set(LAYOUT_METRICS), (got, want)
  assert int(got["skipped"]) == int(want["skipped"]) == 0, (got["skipped"], want["skipped"])
  scales = metric_scales(cfg, logp_bt, batch, ref_logp_bt)
  for key in sorted(set(want) - {"skipped", *LAYOUT_METRICS}):
    # Counts (clip_frac, behaviour_adjusted_frac, moe_dropped_frac) and norms: their own size.
    scale = max(scales.get(key, 0.0), abs(float(want[key])))
    tolerance.assert_close(got[key], want[key], n=terms, scale=scale, err_msg=key)


def run_case(cheap: bool = False, seed: int | None = None) -> dict:
  if seed is None:
    seed = int(os.environ.get("JAXRL_LEARNER_SEED") or np.random.default_rng().integers(1 << 31))
  rng = np.random.default_rng(seed)
  cfg = draw_config(rng, cheap)
  try:
    if rng.random() < 0.1:
      refused(cfg, rng)
    else:
      compare(cfg, rng)
  except BaseException as e:
    e.add_note(f"JAXRL_LEARNER_SEED={seed} replays this run (configuration {cfg}).")
    raise
  return cfg


def compare(cfg, rng) -> None:
  model = MODELS[cfg["kind"]]
  mcfg = model.config
  params = jax.device_get(model.init(int(rng.integers(1 << 16))))
  noise = lambda x: x + 0.02 * rng.normal(size=x.shape).astype(x.dtype)  # noqa: E731
  ref_params = jax.tree.map(noise, params) if cfg["loss"].kl_weight else None
  (chunk_packed, chunk_padded), (run_packed, run_padded) = cfg["chunks"], cfg["executions"]
  padded = make_learner(cfg, params, 0, chunk_padded, run_padded)
  packed = make_learner(cfg, params, cfg["pack"], chunk_packed, run_packed)
  if ref_params is not None:
    padded.ref_params = packed.ref_params = ref_params
  compared, terms, updates = not drops(cfg), 0, 0
  for step in range(2 if cfg["second_batch"] else 1):
    length = cfg["length"] if step == 0 else int(rng.integers(6, LONGEST + 1))
    batch = random_batch(rng, cfg, model, cfg["batch"], length)
    routes = padded._replayed_routes(batch)
    mask = batch.mask_bt if padded._capacity else None
    logp_bt = np.asarray(padded.logprobs(padded.params, batch.tokens_bt, routes, mask))
    batch.old_logp_bt = behaviour_logprobs(rng, cfg, logp_bt, batch.mask_bt)
    ref_logp_bt = None
    if ref_params is not None:
      ref_logp_bt = np.asarray(padded.logprobs(padded.ref_params, batch.tokens_bt, routes, mask))
    forward = tolerance.model_terms(mcfg) + terms  # at parameters rounding has moved
    prox_padded, prox_packed = padded.proximal_logprobs(batch), packed.proximal_logprobs(batch)
    for prox in (prox_padded, prox_packed):
      assert prox.shape == batch.mask_bt.shape and not np.any(prox[batch.mask_bt == 0])
    if compared:
      scale = np.abs(logp_bt * batch.mask_bt).max(initial=0.0)
      tolerance.assert_close(prox_packed, prox_padded, n=forward, scale=scale, err_msg="proximal")
    want, got = padded.update(batch), packed.update(batch)
    check_each(cfg, batch, want, got)
    if not compared:
      continue
    terms, updates = terms + update_terms(cfg, batch.mask_bt.size), updates + cfg["updates"]
    check_same_update(cfg, got, want, batch, logp_bt, ref_logp_bt, terms)
    # Steps from the parameters both started from: those of the second batch add to the first's.
    tolerance.assert_same_update(packed.params, padded.params, params, n=terms, updates=updates)
    if padded._capacity:
      assert float(jax.device_get(want)["moe_dropped_frac"]) == 0.0


def check_each(cfg, batch, want, got) -> None:
  """What holds for each layout on its own (all there is to check where a capacity drops
  assignments, and the layouts differ in which)."""
  rows = np.split(batch.mask_bt, cfg["updates"])
  moe = cfg["moe"] or MoEConfig()
  for name, metrics in (("padded", want), ("packed", got)):
    metrics = jax.device_get(metrics) | {"learner": name}
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"])), metrics
    # The keys say which paths ran: capacity counts, and placements planned for the
    # micro-batches there are (packed, none for rows without a trained target).
    capacity = expert_parallel(cfg) and moe.capacity_factor > 0
    assert ("moe_dropped_frac" in metrics) == capacity, metrics
    assert 0 <= float(metrics.get("moe_dropped_frac", 0)) < 1
    planned = cfg["axes"].get("expert", 1) > 1 and moe.routing_replay
    planned = planned and (name == "padded" or bool(batch.mask_bt.any()))
    assert ("moe_imbalance_planned" in metrics) == planned, metrics
    if cfg["learning_rate"] == 0 and cfg["loss"].proximal == "recompute":
      # Every update at the proximal policy's weights, through the same drops: ratio 1 (a
      # mini-batch with no trained token has none, and a mean of 0).
      ones = np.mean([float(m.any()) for m in rows])
      assert float(metrics["ratio_mean"]) == pytest.approx(ones, abs=1e-5), metrics
      assert float(metrics["clip_frac"]) == 0, metrics


def refused(cfg, rng) -> None:
  """A setting the learner refuses, with a message naming it."""
  model = MODELS[cfg["kind"]]
  cases = ["micro-multiple", "split"]
  if cfg["moe"] is not None and cfg["axes"].get("expert", 1) == 1:
    cases.append("placement")
  if cfg["moe"] is not None and cfg["moe"].routing_replay:
    cases.append("routes")
  case = str(rng.choice(cases))
  if case == "placement":
    moe = MoEConfig(routing_replay=True, placement="least_loaded")
    with pytest.raises(ValueError, match="expert axis"):
      make_learner(dict(cfg, moe=moe), None, cfg["pack"], 128)
    return
  if case == "split" and cfg["micro"] == cfg["updates"] == 1:
    case = "micro-multiple"  # every batch splits into updates of one row
  if case == "micro-multiple":
    axes = {"fsdp": 2} if cfg["kind"] != "dense" or rng.random() < 0.5 else {"data": 2, "fsdp": 2}
    moe = cfg["moe"] and dataclasses.replace(cfg["moe"], placement="static")
    cfg = dict(cfg, axes=axes, micro=3, batch=3 * cfg["updates"], moe=moe)
  learner = make_learner(cfg, None, cfg["pack"], 128)
  size = cfg["batch"] + (1 if case == "split" else 0)
  batch = random_batch(rng, cfg, model, size, cfg["length"])
  if case == "routes":
    batch.routes_btlk = None
  match = {
    "micro-multiple": r"micro_batch_size=3 must be a multiple of the training mesh's data\*fsdp",
    "split": r"train.updates_per_step=\d+ updates of whole micro-batches",
    "routes": "routing_replay needs the rollout's routing trace",
  }[case]
  with pytest.raises(ValueError, match=match):
    learner.update(batch)


# Seeds that find the bugs this test found (while the draws above stay as they are, each
# replays its run): 130 and 139, decoupled PPO's packed proximal log-probs packed the whole
# batch at once, not each update's rows as the update does (with an expert capacity, other
# drops: the first update started away from ratio 1); 100 and 145, a packed mini-batch with no
# trained target packed into no micro-batch, and planning its expert placements raised.
KEPT_SEEDS = [100, 130, 139, 145]


@pytest.mark.slow
@pytest.mark.parametrize("seed", KEPT_SEEDS)
def test_the_seeds_that_found_bugs(seed):
  run_case(seed=seed)


def test_a_random_learner_configuration_trains_packed_as_padded():
  run_case(cheap=True)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(10))
def test_random_learner_configurations_train_packed_as_padded(run):
  run_case()
