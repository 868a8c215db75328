"""Static engine and sampler tests on a 4-device rollout mesh."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tolerance
from helpers.compiles import compiled_functions
from helpers.host_reads import whole_arrays_read_on_the_host
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.model import Model, get_preset
from jaxrl.rl.experience import logprob_mismatch
from jaxrl.rollout import (
  PagedConfig,
  PagedEngine,
  SamplingParams,
  StaticEngine,
  filter_logits,
  sample_tokens,
)
from jaxrl.rollout.sampling import (
  NO_FILTER,
  SAMPLE_BLOCK,
  SORT_ALL,
  TOP_K_CANDIDATES,
  VocabSplit,
  _first_above,
  _threshold_on_vocab_shards,
  draw_from_logits,
  filter_width,
  first_argmax,
  sample_block,
)
from jaxrl.sharding import ROLLOUT_RULES, TRAIN_RULES, make_mesh, tree_shardings
from jaxrl.train import Learner, LossConfig, OptimizerConfig

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def setup():
  model = Model(get_preset("tiny"))
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})
  engine = StaticEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD)
  params = model.init(np.random.randint(1 << 16))
  engine.update_weights(params, version=7)
  return model, engine, params


def _prompts(n, rng):
  return [list(rng.integers(3, 60, rng.integers(2, 9))) for _ in range(n)]


def test_weights_land_on_rollout_mesh(setup):
  _, engine, _ = setup
  wq = engine.params["blocks"][0]["attn"]["wq_dhe"]
  assert {d.id for d in wq.sharding.device_set} == {d.id for d in engine.mesh.devices.flat}
  # heads are split over tensor=2: each shard holds half of the 4 heads.
  assert {s.data.shape for s in wq.addressable_shards} == {(128, 2, 32)}


@pytest.mark.parametrize("engine_class", [StaticEngine, PagedEngine])
def test_fp32_master_weights_reach_a_bf16_engine_compiling_the_cast_once(engine_class, monkeypatch):
  """What the RL job does at every step: the learner's fp32 weights, on its own devices (or as
  host arrays from a store, or as the store's bf16 copy on the learner's devices), become the
  engine's bf16 weights on the rollout devices. The cast compiles at the first update of each
  source only (it was traced and compiled anew at every update), and the values are the fp32
  ones rounded to bf16. From other devices the weights move device to device: no array is
  read whole onto the host on the way (fsdp over 4 devices to the engine's data x tensor
  pieces; `device_put` alone went through the host)."""
  rollout_model = Model(get_preset("tiny", dtype="bfloat16", param_dtype="bfloat16"))
  learner_model = Model(get_preset("tiny", dtype="bfloat16", param_dtype="float32"))
  devices = jax.devices()
  rollout_mesh = make_mesh(devices[:4], {"data": 2, "tensor": 2})
  train_mesh = make_mesh(devices[4:8], {"fsdp": 4})
  kwargs = {"config": PagedConfig(num_pages=16)} if engine_class is PagedEngine else {}
  engine = engine_class(
    rollout_model, rollout_mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, **kwargs
  )
  shapes = jax.tree.map(lambda x: x.shape, learner_model.abstract_params())
  train_shardings = tree_shardings(learner_model.logical_axes, train_mesh, TRAIN_RULES, shapes)
  # On CPU engines move weights between devices by `device_put` (through the host, which is
  # where a CPU device's memory is): here device to device, as on accelerators.
  assert not engine._placer.device_to_device
  engine._placer.device_to_device = True
  bf16 = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
  for source in ("devices", "host", "bf16 on devices"):
    compiles = []
    for version in range(3):
      fp32 = learner_model.init(version)
      weights = {
        "devices": lambda p: jax.device_put(p, train_shardings),
        "host": jax.device_get,
        "bf16 on devices": lambda p: bf16(jax.device_put(p, train_shardings)),
      }[source](fp32)
      with compiled_functions() as seen, whole_arrays_read_on_the_host(monkeypatch) as read:
        engine.update_weights(weights, version)
        jax.block_until_ready(engine.params)
      compiles.append(len(seen))
      assert source == "host" or not read, (source, read)
      for got, want, sharding in zip(
        *(jax.tree.leaves(t) for t in (engine.params, fp32, engine.param_shardings)), strict=True
      ):
        assert got.dtype == jnp.bfloat16 and got.sharding.is_equivalent_to(sharding, got.ndim)
        np.testing.assert_array_equal(
          np.asarray(got), np.asarray(want).astype(jnp.bfloat16), err_msg=source
        )
    # The first update of a source that needs a cast compiles it (the bf16 copy needs none;
    # the programs that move pieces between devices are shared by every engine).
    assert compiles[1:] == [0, 0] and (compiles[0] >= 1 or source == "bf16 on devices"), (
      source,
      compiles,
    )


def test_greedy_is_deterministic_and_matches_manual_argmax(setup):
  model, engine, params = setup
  rng = np.random.default_rng()
  prompts = _prompts(5, rng)
  sp = SamplingParams(temperature=0.0, max_new_tokens=6)
  a = engine.generate(prompts, sp, seed=1)
  b = engine.generate(prompts, sp, seed=2)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x.token_ids, y.token_ids)
    assert (x.versions == 7).all()
  # Greedy decoding by full forward passes, no cache.
  forward = jax.jit(model.apply)
  for prompt, out in zip(prompts, a, strict=True):
    seq = list(prompt)
    for tok in out.token_ids:
      padded = np.zeros((1, 16), np.int32)
      padded[0, : len(seq)] = seq
      logits, _ = forward(params, jnp.asarray(padded))
      assert int(jnp.argmax(logits[0, len(seq) - 1])) == tok
      seq.append(int(tok))
    assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS else "length")
    assert len(out.token_ids) == 6 or out.token_ids[-1] == EOS


def test_stop_tokens_and_max_new_tokens(setup):
  _, engine, _ = setup
  rng = np.random.default_rng()
  prompts = _prompts(8, rng)
  free = engine.generate(prompts, SamplingParams(max_new_tokens=12), seed=3)
  stop = int(free[0].token_ids[0])
  out = engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)), seed=3)
  for f, o in zip(free, out, strict=True):
    # Same seed, same tokens until the first stop token, which ends the response.
    cut = next((i + 1 for i, t in enumerate(f.token_ids) if t in (stop, EOS)), len(f.token_ids))
    np.testing.assert_array_equal(o.token_ids, f.token_ids[:cut])
  short = engine.generate(
    prompts, [SamplingParams(max_new_tokens=k % 4 + 1) for k in range(8)], seed=4
  )
  for k, o in enumerate(short):
    assert 1 <= len(o.token_ids) <= k % 4 + 1


def test_top_k_top_p_sample_only_allowed_tokens():
  rng = np.random.default_rng()
  logits = jnp.asarray(rng.normal(size=(6, 40)) * 3, jnp.float32)
  top_k = jnp.array([1, 3, 5, 0, 0, 4], jnp.int32)
  top_p = jnp.array([1.0, 1.0, 1.0, 0.5, 0.9, 0.3], jnp.float32)
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  allowed = []
  for b in range(6):
    order = np.argsort(-probs[b])
    keep = order[: top_k[b]] if top_k[b] else order
    p = probs[b][keep] / probs[b][keep].sum()
    before = np.cumsum(p) - p
    allowed.append(set(keep[before < top_p[b]].tolist()))
  masked = np.asarray(filter_logits(logits, top_k, top_p))
  for b in range(6):
    assert set(np.flatnonzero(np.isfinite(masked[b])).tolist()) == allowed[b]
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 300)
  draw = lambda k: sample_tokens(jax.random.split(k, 6), logits, jnp.ones(6), top_k, top_p)  # noqa: E731
  toks, logp = jax.jit(jax.vmap(draw))(keys)
  toks, logp = np.asarray(toks), np.asarray(logp)
  seen = [set(toks[:, b].tolist()) for b in range(6)]
  # The log-prob is that of the renormalised filtered distribution.
  renorm = np.asarray(jax.nn.log_softmax(jnp.asarray(masked), axis=-1))
  # A log-softmax over 40 logits: its rounding scales with the logits.
  want = renorm[np.arange(6)[None], toks]
  tolerance.assert_close(logp, want, n=logits.shape[-1], scale=np.abs(logits).max())
  for b in range(6):
    assert seen[b] <= allowed[b]
  assert len(seen[0]) == 1 and len(seen[2]) > 1


def _chi_square_z(tokens, probs) -> float:
  """How many standard deviations a chi-square statistic of the drawn tokens lies above its
  mean under `probs` (bins expecting fewer than 5 draws pooled; normal approximation)."""
  n = len(tokens)
  counts, expected = np.bincount(tokens, minlength=len(probs)), probs * n
  big = expected >= 5
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(expected[big], expected[~big].sum())
  if expected[-1] == 0:  # bins of no mass only: none may be drawn, and they add no freedom
    assert observed[-1] == 0, "drew a token of probability 0"
    observed, expected = observed[:-1], expected[:-1]
  chi = np.sum((observed - expected) ** 2 / expected)
  dof = len(observed) - 1
  return (chi - dof) / np.sqrt(2 * dof)


def test_sample_block_divides_the_vocabulary_where_a_power_of_two_does():
  assert sample_block(151936) == 128 and sample_block(32768) == SAMPLE_BLOCK
  assert sample_block(1280) == 256 and sample_block(128256) == 256
  assert sample_block(1300) == SAMPLE_BLOCK  # no power of two from 64 up: padded


# 1,300 entries: two whole blocks of SAMPLE_BLOCK and a padded third; 1,280: five of 256.
@pytest.mark.parametrize("vocab", [1300, 1280])
def test_sampler_draws_from_the_softmax_at_each_temperature(vocab):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, vocab)) * 2, jnp.float32)
  temperature = jnp.array([1.0, 0.7, 1.3], jnp.float32)
  keys = jax.random.split(jax.random.key(1), 20000 * 3).reshape(20000, 3)
  draw = jax.jit(
    jax.vmap(lambda k: sample_tokens(k, logits, temperature, jnp.zeros(3, jnp.int32), jnp.ones(3)))
  )
  tokens = np.asarray(draw(keys)[0])
  for row in range(3):
    scaled = np.asarray(logits[row], np.float64) / float(temperature[row])
    probs = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    # A wrong block or token choice moves it by hundreds; chance alone rarely past 4.
    assert _chi_square_z(tokens[:, row], probs) < 6.0, row


def test_inverse_cdf_draw_keeps_to_tokens_with_mass_at_the_uniforms_ends():
  block = SAMPLE_BLOCK
  logits = np.full((3, 3 * block + 5), -np.inf, np.float32)
  logits[0, [3, 700]] = [0.0, 1.0]  # mass in blocks 0 and 1, none in the last two
  logits[1, 3 * block + 4] = 2.0  # one token, in the padded last block
  logits[2] = np.linspace(-3, 3, logits.shape[1])
  logits = jnp.asarray(logits)
  max_b = jnp.max(logits, axis=-1)
  below_one = np.nextafter(np.float32(1), np.float32(0))
  for u in (0.0, below_one):
    tokens, lse = draw_from_logits(jnp.full((3, 2), u, jnp.float32), logits, max_b)
    tokens = np.asarray(tokens)
    assert tokens[0] == (3 if u == 0 else 700) and tokens[1] == 3 * block + 4
    assert tokens[2] == (0 if u == 0 else logits.shape[1] - 1)
    tolerance.assert_close(lse, jax.nn.logsumexp(logits, axis=-1), n=logits.shape[1])


def test_inverse_cdf_draw_never_lands_on_a_token_without_mass():
  # XLA's cumsum adds out of order: across entries of no mass the running sum may step down
  # by a rounding unit. A target inside such a step must still pick an entry with mass.
  cumulative = jnp.asarray([[1.0, np.nextafter(np.float32(1), np.float32(0)), 2.0]], jnp.float32)
  mass = jnp.asarray([[1.0, 0.0, 1.0]], jnp.float32)
  target = jnp.asarray([np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
  assert int(_first_above(cumulative, target, mass)[0]) == 0
  assert int(_first_above(cumulative, jnp.asarray([1.5]), mass)[0]) == 2
  assert int(_first_above(cumulative, jnp.asarray([2.5]), mass)[0]) == 2  # past the total


def test_top_k_with_top_p_one_keeps_all_k_next_to_a_dominant_token():
  # The mass before the 2nd..8th tokens rounds to 1.0 beside a logit 40 above the rest; top_p
  # = 1 must still keep the k of top-k.
  logits = jnp.asarray([[40.0, *np.linspace(1.0, -1.0, 49)]], jnp.float32)
  for width in (TOP_K_CANDIDATES, SORT_ALL):
    kept = filter_logits(logits, jnp.array([8]), jnp.array([1.0]), width=width)
    assert int(np.isfinite(np.asarray(kept)).sum()) == 8, width


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1.0])
def test_temperature_must_be_finite_and_non_negative(temperature):
  with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
    SamplingParams(temperature=temperature)


def test_first_argmax_breaks_ties_low():
  rng = np.random.default_rng()
  logits = jnp.asarray(rng.normal(size=(5, 300)) * 2, jnp.float32)
  tied = jnp.asarray(rng.integers(0, 3, size=(64, 50)), jnp.float32)  # many ties
  np.testing.assert_array_equal(first_argmax(tied), jnp.argmax(tied, axis=-1))
  np.testing.assert_array_equal(first_argmax(logits), jnp.argmax(logits, axis=-1))


@pytest.mark.parametrize("width", [NO_FILTER, TOP_K_CANDIDATES, SORT_ALL])
def test_sampler_logprobs_equal_float64_for_greedy_and_sampled_rows(width):
  rng = np.random.default_rng()
  b, v = 6, 500
  logits = jnp.asarray(rng.normal(size=(b, v)) * 4, jnp.float32)
  temperature = jnp.array([0.0, 0.7, 1.0, 1.3, 0.0, 1.0], jnp.float32)
  # Top-p alone needs the whole row sorted; with a top-k it lies inside lax.top_k's candidates.
  top_k = {NO_FILTER: [0] * 6, TOP_K_CANDIDATES: [0, 20, 7, 0, 3, 64], SORT_ALL: [0, 0, 7, 0, 3, 0]}
  top_p = [1.0, 0.8 if width != NO_FILTER else 1.0, 1.0, 1.0, 1.0, 1.0]
  params = [SamplingParams(top_k=k, top_p=p) for k, p in zip(top_k[width], top_p, strict=True)]
  assert filter_width(params) == width
  top_k, top_p = jnp.array(top_k[width], jnp.int32), jnp.array(top_p, jnp.float32)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), b)
  sample = jax.jit(sample_tokens, static_argnames="filter_width")
  toks, logp = sample(keys, logits, temperature, top_k, top_p, filter_width=width)
  toks, logp = np.asarray(toks), np.asarray(logp)
  x = np.asarray(logits, np.float64)
  masked = np.asarray(
    filter_logits(logits / jnp.where(temperature > 0, temperature, 1)[:, None], top_k, top_p)
  )
  for row in range(b):
    t = float(temperature[row])
    # Greedy rows: the argmax, scored at temperature 1 without the filter; others: the
    # filtered, temperature-scaled distribution, renormalised.
    scores = x[row] if t == 0 else np.where(np.isfinite(masked[row]), x[row] / t, -np.inf)
    want = scores[toks[row]] - (np.log(np.sum(np.exp(scores - scores.max()))) + scores.max())
    if t == 0:
      assert toks[row] == np.argmax(x[row])
    assert np.isfinite(masked[row, toks[row]])
    tolerance.assert_close(logp[row], want, n=v, scale=np.abs(x[row]).max() / (t or 1.0))
  if width != SORT_ALL:  # the sorting variant gives the same draw
    again = sample(keys, logits, temperature, top_k, top_p, filter_width=SORT_ALL)
    np.testing.assert_array_equal(again[0], toks)
    tolerance.assert_close(again[1], logp, n=v, scale=float(np.abs(x).max()) / 0.7)


def test_top_k_candidates_filter_like_the_whole_sorted_row():
  """lax.top_k's candidates keep exactly what sorting the vocabulary keeps, ties included, and
  ties at the k-th value that run past the candidates (they take nucleus mass too)."""
  top_k = jnp.array([1, 5, 17, 64, 0, 2, 33, 64], jnp.int32)
  top_p = jnp.array([1.0, 0.5, 0.9, 0.95, 1.0, 0.3, 1.0, 0.8], jnp.float32)
  tied_past_candidates = 0
  for seed in range(16):
    rng = np.random.default_rng(seed)
    logits = np.asarray(rng.integers(-20, 20, size=(8, 300)) / 4, np.float32)  # many ties
    ordered = np.sort(logits[3])[::-1]
    tied_past_candidates += int(ordered[TOP_K_CANDIDATES] == ordered[TOP_K_CANDIDATES - 1])
    full = filter_logits(jnp.asarray(logits), top_k, top_p, width=SORT_ALL)
    candidates = filter_logits(jnp.asarray(logits), top_k, top_p, width=TOP_K_CANDIDATES)
    np.testing.assert_array_equal(np.isfinite(full), np.isfinite(candidates), err_msg=f"{seed=}")
    assert np.isfinite(np.asarray(full)[4]).all()  # a row without top-k and top-p keeps all
  assert tied_past_candidates > 0  # the case that needs the whole row's top-k mass was met


def test_rollout_logprobs_match_learner(setup):
  model, engine, params = setup
  train_mesh = make_mesh(jax.devices()[4:], {"fsdp": 4})
  temperature = 0.7
  learner = Learner(
    model,
    train_mesh,
    TRAIN_RULES,
    loss=LossConfig(),
    optimizer=OptimizerConfig(),
    updates_per_step=1,
    micro_batch_size=8,
    temperature=temperature,
    params=params,
  )
  rng = np.random.default_rng()
  prompts = _prompts(8, rng)
  outs = engine.generate(
    prompts,
    SamplingParams(temperature=temperature, max_new_tokens=10),
    seed=int(rng.integers(1 << 30)),
  )
  mismatch = logprob_mismatch(learner, outs, PAD)
  assert mismatch["tokens"] > 8
  # Same weights, other shardings (tensor vs fsdp) and kernels: apart by rounding only.
  scale = max(np.abs(c.logprobs).max() for c in outs)
  allowed = tolerance.atol(tolerance.model_terms(model.config), scale)
  assert mismatch["max_abs_diff"] <= allowed, f"train/inference log-prob mismatch {mismatch}"


def test_bad_requests_rejected_at_submit(setup):
  _, engine, _ = setup
  with pytest.raises(ValueError, match="max_seq_len"):
    engine.generate([[5] * 60], SamplingParams(max_new_tokens=10), seed=0)
  with pytest.raises(ValueError, match="empty prompt"):
    engine.generate([[]], SamplingParams(), seed=0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)


# -- the sampler on each device's part of the vocabulary (`sampling.VocabSplit`) -----------------


def _split_sampler(mesh):
  split = VocabSplit(mesh, ("data",), ("tensor",))

  def sample(keys, logits, temperature):
    b = logits.shape[0]
    zeros, ones = jnp.zeros(b, jnp.int32), jnp.ones(b)
    return sample_tokens(
      keys, logits, temperature, zeros, ones, filter_width=NO_FILTER, vocab_split=split
    )

  return jax.jit(sample)


def test_vocab_split_sampler_draws_what_the_whole_vocabulary_draws():
  """Each device's part of 2,048 logits is whole blocks of 512: the same blocks, the same draw.
  Greedy rows take the first maximum across devices; nothing of `[b, v]` crosses devices."""
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})
  rng = np.random.default_rng()
  b, v = 8, 4096
  logits = np.asarray(rng.normal(size=(b, v)) * 3, np.float32)
  logits[0, [100, 3000]] = logits[0].max() + 1.0  # tied maxima on both devices: 100 wins
  temperature = jnp.array([0.0, 1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 1.0], jnp.float32)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), b)
  zeros, ones = jnp.zeros(b, jnp.int32), jnp.ones(b)
  want = sample_tokens(keys, jnp.asarray(logits), temperature, zeros, ones, filter_width=NO_FILTER)
  sharded = jax.device_put(logits, NamedSharding(mesh, P("data", "tensor")))
  sample = _split_sampler(mesh)
  got = sample(keys, sharded, temperature)
  np.testing.assert_array_equal(got[0], want[0])
  assert int(got[0][0]) == 100 and int(got[0][4]) == int(np.argmax(logits[4]))
  tolerance.assert_close(got[1], want[1], n=v, scale=float(np.abs(logits).max()) / 0.7)
  text = sample.lower(keys, sharded, temperature).compile().as_text()
  gathered = [int(np.prod([int(d) for d in dims.split(",")])) for dims in
              re.findall(r"= \w+\[([\d,]+)\]\S* all-gather", text)]  # fmt: skip
  assert gathered and max(gathered) < b * v // 16, gathered  # each device's [b/2, v/2] is not


def _nucleus_probs(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """float64 oracle: softmax(scaled) restricted to its top-k set and top-p nucleus (no ties)."""
  order = np.argsort(-scaled)
  keep = order[:top_k] if top_k else order
  probs = np.exp(scaled[keep] - scaled.max())
  probs /= probs.sum()
  kept = keep[np.cumsum(probs) - probs < top_p]
  out = np.zeros_like(scaled)
  out[kept] = np.exp(scaled[kept] - scaled.max())
  return out / out.sum()


FILTERS = {  # per filter width, three rows' (top_k, top_p)
  NO_FILTER: ([0, 0, 0], [1.0, 1.0, 1.0]),
  TOP_K_CANDIDATES: ([20, 64, 0], [1.0, 0.6, 1.0]),
  SORT_ALL: ([0, 100, 0], [0.8, 1.0, 0.5]),
}


@pytest.mark.parametrize("width", [NO_FILTER, TOP_K_CANDIDATES, SORT_ALL])
def test_vocab_split_sampler_draws_from_the_softmax_where_parts_are_not_whole_blocks(width):
  """1,280 entries in blocks of 256 over 2 devices: 640 each, 2.5 blocks, padded on each; the
  filtered rows draw from their top-k set and nucleus, renormalised."""
  mesh = make_mesh(jax.devices()[:2], {"tensor": 2})
  rng = np.random.default_rng(0)
  logits = np.asarray(rng.normal(size=(3, 1280)) * 2, np.float32)
  temperature = jnp.array([1.0, 0.7, 1.2], jnp.float32)
  top_k, top_p = FILTERS[width]
  params = [SamplingParams(top_k=k, top_p=p) for k, p in zip(top_k, top_p, strict=True)]
  assert filter_width(params) == width
  split = VocabSplit(mesh, (), ("tensor",))
  top_k_b, top_p_b = jnp.array(top_k, jnp.int32), jnp.array(top_p, jnp.float32)
  sharded = jax.device_put(logits, NamedSharding(mesh, P(None, "tensor")))
  draw = jax.jit(
    jax.vmap(
      lambda k: sample_tokens(
        k, sharded, temperature, top_k_b, top_p_b, filter_width=width, vocab_split=split
      )  # fmt: skip
    )
  )
  tokens, logprobs = draw(jax.random.split(jax.random.key(2), 20000 * 3).reshape(20000, 3))
  tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
  for row in range(3):
    scaled = logits[row].astype(np.float64) / float(temperature[row])
    probs = _nucleus_probs(scaled, top_k[row], top_p[row])
    assert _chi_square_z(tokens[:, row], probs) < 6.0, row
    assert np.all(probs[tokens[:, row]] > 0), row
    want = np.log(probs[tokens[:100, row]])
    tolerance.assert_close(logprobs[:100, row], want, n=1280, scale=4.0)


def test_vocab_split_top_k_draws_what_the_whole_vocabulary_draws():
  """With top-k (and top-p within it) each device filters its own part: the same kept tokens,
  so where parts are whole blocks the same draws and log-probs as the whole vocabulary's;
  across devices only each part's 64 largest logits, no `[b, v]`."""
  mesh = make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})
  split = VocabSplit(mesh, ("data",), ("tensor",))
  rng = np.random.default_rng()
  b, v = 8, 4096
  logits = np.asarray(rng.integers(-40, 40, size=(b, v)) / 4, np.float32)  # many ties
  temperature = jnp.array([0.0, 1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 1.0], jnp.float32)
  top_k = jnp.array([5, 1, 20, 64, 0, 7, 0, 40], jnp.int32)
  top_p = jnp.array([1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 1.0, 0.3], jnp.float32)
  sharded = jax.device_put(logits, NamedSharding(mesh, P("data", "tensor")))
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 64 * b).reshape(64, b)

  def sample(keys, logits, vocab_split):
    return sample_tokens(
      keys, logits, temperature, top_k, top_p, filter_width=TOP_K_CANDIDATES,
      vocab_split=vocab_split,
    )  # fmt: skip

  split_draws = jax.jit(jax.vmap(lambda k, x: sample(k, x, split), in_axes=(0, None)))
  want = jax.jit(jax.vmap(lambda k, x: sample(k, x, None), in_axes=(0, None)))(keys, logits)
  got = split_draws(keys, sharded)
  np.testing.assert_array_equal(got[0], want[0])
  assert np.all(np.asarray(got[0])[:, 0] == np.argmax(logits[0]))  # greedy: the first max
  tolerance.assert_close(got[1], want[1], n=v, scale=float(np.abs(logits).max()) / 0.7)
  text = split_draws.lower(keys, sharded).compile().as_text()
  gathered = [int(np.prod([int(d) for d in dims.split(",")])) for dims in
              re.findall(r"= \w+\[([\d,]+)\]\S* all-gather", text)]  # fmt: skip
  assert gathered and max(gathered) < 64 * b * v // 16, gathered  # no device's [b/2, v/2]


def test_a_rows_draw_on_a_vocab_split_does_not_depend_on_its_neighbours_filters():
  """The same keys and logits, unfiltered rows, in calls whose filter is chosen by other rows
  (none, a top-k, a top-p): the same tokens and log-probs, where parts are not whole blocks
  (the whole row's blocks would draw differently)."""
  mesh = make_mesh(jax.devices()[:2], {"tensor": 2})
  split = VocabSplit(mesh, (), ("tensor",))
  rng = np.random.default_rng()
  logits = np.asarray(rng.normal(size=(4, 1280)) * 2, np.float32)
  sharded = jax.device_put(logits, NamedSharding(mesh, P(None, "tensor")))
  temperature = jnp.array([1.0, 0.7, 0.0, 1.0], jnp.float32)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 64 * 4).reshape(64, 4)
  draws = {}
  for width, last_row in (
    (NO_FILTER, (0, 1.0)),
    (TOP_K_CANDIDATES, (5, 1.0)),
    (SORT_ALL, (0, 0.5)),
  ):
    top_k_b = jnp.array([0, 0, 0, last_row[0]], jnp.int32)
    top_p_b = jnp.array([1.0, 1.0, 1.0, last_row[1]], jnp.float32)
    draw = jax.vmap(
      lambda k, x, w=width, k_b=top_k_b, p_b=top_p_b: sample_tokens(
        k, x, temperature, k_b, p_b, filter_width=w, vocab_split=split
      ),
      in_axes=(0, None),
    )
    draws[width] = [np.asarray(a)[:, :3] for a in jax.jit(draw)(keys, sharded)]
  for width in (TOP_K_CANDIDATES, SORT_ALL):
    np.testing.assert_array_equal(draws[width][0], draws[NO_FILTER][0], err_msg=f"{width=}")
    tolerance.assert_close(draws[width][1], draws[NO_FILTER][1], n=1280, scale=8.0)


@pytest.mark.parametrize("width", [TOP_K_CANDIDATES, SORT_ALL])
def test_vocab_split_filter_keeps_what_the_whole_row_keeps(width):
  """Each device's part keeps exactly what `filter_logits` keeps of the whole row, ties at the
  k-th value included, also where they run past the 64 candidates and over both devices; with
  SORT_ALL also top-k sets past 64 and nuclei without a top-k."""
  mesh = make_mesh(jax.devices()[:2], {"tensor": 2})
  top_k = (
    [1, 5, 17, 64, 0, 2, 33, 64] if width == TOP_K_CANDIDATES else [1, 0, 100, 0, 0, 2, 300, 0]
  )
  top_k = jnp.array(top_k, jnp.int32)
  top_p = jnp.array([1.0, 0.5, 0.9, 0.95, 1.0, 0.3, 1.0, 0.8], jnp.float32)

  def kept(logits_bv):
    max_b = jax.lax.pmax(jnp.max(logits_bv, axis=-1), "tensor")
    threshold_b1 = _threshold_on_vocab_shards(logits_bv, max_b, top_k, top_p, width, ("tensor",))
    return logits_bv >= threshold_b1

  split_kept = jax.jit(
    jax.shard_map(kept, mesh=mesh, in_specs=P(None, "tensor"), out_specs=P(None, "tensor"))
  )
  tied_past_candidates = 0
  for seed in range(16):
    rng = np.random.default_rng(seed)
    logits = np.asarray(rng.integers(-20, 20, size=(8, 600)) / 4, np.float32)
    ordered = np.sort(logits[3])[::-1]
    tied_past_candidates += int(ordered[TOP_K_CANDIDATES] == ordered[TOP_K_CANDIDATES - 1])
    whole = filter_logits(jnp.asarray(logits), top_k, top_p, width=SORT_ALL)
    np.testing.assert_array_equal(
      split_kept(jnp.asarray(logits)), np.isfinite(whole), err_msg=f"{seed=}"
    )
  assert tied_past_candidates > 0
