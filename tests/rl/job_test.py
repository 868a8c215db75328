"""End-to-end RL job tests on the 8 simulated CPU devices (3-step runs, resume, bad input)."""

import dataclasses
import json
import os
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.metrics import MetricsWriter, read_metrics
from jaxrl.rl import job
from jaxrl.rl.checkpoint import Checkpointer
from jaxrl.rl.controller import Controller
from jaxrl.rl.placement import make_placement, place_stages
from jaxrl.rl.stages import worker_count
from jaxrl.rl.timeline import load_segments
from jaxrl.scheduler.local import plan_for_experiment
from jaxrl.train.learner import Learner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(arg="test", **overrides):
  return load_config(os.path.join(REPO, "configs", "grpo_tiny.py"), arg, overrides)


# "moe" is `slow` (155 s in a loaded full run on 2 cores); MoE runs by default in the paged
# engine's routing trace test, the expert-parallel learner tests and routing replay's.
# "colocated" is `slow` (49 s in a loaded full run): the colocated loop, its eval included,
# runs by default in test_colocated_rollout_engine_is_empty_while_the_learner_trains, and a
# colocated job with a warm-up in launch_test's one-device run.
@pytest.mark.parametrize(
  "arg",
  [
    "test",
    pytest.param("colocated", marks=pytest.mark.slow),
    pytest.param("moe", marks=pytest.mark.slow),
  ],
)
def test_three_step_run_completes(tmp_path, arg):
  """A variant as a job: warm-up, eval at the start and the end, 3 RL steps; its metrics,
  plots and stage timeline. A demo variant is cut to the test variant's size, with an eval
  batch as large as a rollout batch (16 sequences), so that eval decodes with the programs
  rollout compiled instead of compiling its own."""
  overrides = {}
  if arg != "test":
    overrides = {
      "warmup.steps": 2,
      "rollout.prompts_per_step": 4,
      "rollout.group_size": 4,
      "train.steps": 3,
      "train.micro_batch_size": 8,
      "eval.every": 3,
      "eval.num_prompts": 16,
      "checkpoint.every": 0,
    }
  cfg = tiny_config(arg, **overrides)
  modes = {"colocated": "colocated", "fixed": "disaggregated", "moe": "disaggregated"}
  assert cfg.placement.mode == modes.get(arg, "planned")
  summary = job.run(cfg, str(tmp_path), show_progress=False)
  assert summary["steps"] == 3
  records = read_metrics(str(tmp_path / "metrics.jsonl"))
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3]
  for r in train:
    for key in (
      "reward_mean",
      "response_length",
      "loss",
      "kl",
      "clip_frac",
      "time_wait",
      "time_reward",
      "time_train",
      "time_weight_sync",
    ):
      assert np.isfinite(r[key]), key
    assert r["version"] == r["step"]
    if arg == "moe":  # expert placements planned from the replayed routes of every step
      assert 1.0 <= r["moe_imbalance_planned"] <= r["moe_imbalance_static"]
  assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3]
  assert (tmp_path / "reward_curve.png").stat().st_size > 1000
  assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
  assert (tmp_path / "stage_timeline.png").stat().st_size > 1000
  spans = load_segments(str(tmp_path / "timeline.json"))
  # One update per step on the learner's lane; the worker decoded before each, never during
  # one (sync).
  train = [(s, e) for lane, s, e, kind in spans if (lane, kind) == ("learner", "train")]
  decode = [(s, e) for lane, s, e, kind in spans if lane == "worker w0" and kind == "decode"]
  assert len(train) == 3 and len(decode) >= 3
  for t_start, t_end in train:
    assert any(d_end <= t_start for _, d_end in decode)
    assert not any(d_start < t_end and t_start < d_end for d_start, d_end in decode)
  assert os.listdir(tmp_path / "tensorboard")


def test_placements_use_the_configured_devices():
  cfg = tiny_config("fixed")
  p = make_placement(cfg.placement)
  rollout = {d.id for d in p.rollout_mesh.devices.flat}
  train = {d.id for d in p.train_mesh.devices.flat}
  assert len(rollout) == 4 and len(train) == 4 and not rollout & train
  colocated = make_placement(tiny_config("colocated").placement)
  assert colocated.rollout_mesh.devices.flat[0] == colocated.train_mesh.devices.flat[0]
  assert colocated.shares_devices and not p.shares_devices


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_auto_max_tokens_sizes_engine_shapes_on_accelerators_only(tmp_path, monkeypatch, backend):
  """`rollout.paged.max_tokens=-1`: on an accelerator the job sizes the engine's shapes for its
  longest prompt plus `max_new_tokens`; on CPU it leaves them bucketed (0)."""
  monkeypatch.setattr(job.jax, "default_backend", lambda: backend)
  cfg = tiny_config("test", **{"eval.every": 0})
  assert cfg.rollout.paged.max_tokens == -1
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  sized = controller.rollout.cfg.max_tokens
  if backend == "cpu":
    assert sized == 0
  else:
    records = controller.task.records("train", None, cfg.seed)[:1024]
    prompts = controller.encode_prompts(records)
    longest = max(len(p) for p in prompts) + cfg.rollout.sampling.max_new_tokens
    assert sized == min(longest, cfg.model.max_seq_len)


def test_colocated_rollout_engine_is_empty_while_the_learner_trains(tmp_path, monkeypatch):
  """Sync and colocated: the store is lent the learner's live buffers (no copy), the worker's
  engine drops its weights and pages during the update, which recalls the lent buffers before
  donating them, and the engine takes the next version after it. The eval engine (on the same
  devices) evaluates the version trained and drops its weights after each eval."""
  overrides = {"rollout.prompts_per_step": 4, "rollout.group_size": 4, "train.micro_batch_size": 8}
  evals = {"eval.every": 2, "eval.num_prompts": 16}  # as large as a rollout batch
  cfg = tiny_config("colocated", **{**evals, **overrides})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  assert controller.free_rollout_during_train and controller.loop.mode == "sync"
  (worker,) = controller.initial_workers
  learner, store = controller.learner, controller.weights
  lent = []

  def look_at_the_store(c):
    if not lent:  # published at the start of run: the learner's own arrays
      lent.extend(jax.tree.leaves(store.latest()[1]))
      assert all(a is b for a, b in zip(lent, jax.tree.leaves(learner.params), strict=True))

  seen = []
  update = learner.update

  def update_and_look(batch):
    seen.append((worker.engine.params, worker.engine._kv))
    out = update(batch)
    # The update recalled them from the store before donating them: no reader gets deleted
    # arrays (a late pull gets nothing; `latest` says why).
    assert all(a.is_deleted() for a in lent)
    assert store.pull(-1) is None
    with pytest.raises(RuntimeError, match="recalled by the learner before it updated"):
      store.latest()
    return out

  controller.hooks.append(look_at_the_store)
  monkeypatch.setattr(learner, "update", update_and_look)
  controller.run(until=2)
  assert seen == [(None, None)] * 2  # dropped during each update
  assert worker.engine.version >= 1  # it took version 1 after the first update to decode
  assert store.pull(0)[0] == 2  # lent again after the last update
  evals = [r for r in read_metrics(controller.writer.path) if r["kind"] == "eval"]
  assert [r["step"] for r in evals] == [0, 2]
  assert all(0.0 <= r["eval_reward"] <= 1.0 for r in evals)
  assert controller.rollout.version == 2 and controller.rollout.params is None


def test_planned_placement_takes_split_and_meshes_from_the_planner():
  cfg = tiny_config()
  plan = plan_for_experiment(cfg, prompt_len=12)
  p = make_placement(cfg.placement, plan=plan)
  rollout = {d.id for d in p.rollout_mesh.devices.flat}
  train = {d.id for d in p.train_mesh.devices.flat}
  assert not rollout & train and len(rollout | train) <= len(jax.devices())
  assert len(train) == plan.train.devices
  assert len(rollout) == sum(r.devices for r in plan.rollout)
  assert dict(p.train_mesh.shape) == plan.train.mesh
  with pytest.raises(ConfigError, match="needs a plan"):
    make_placement(cfg.placement)
  assert place_stages(cfg, prompt_len=12).train_mesh.shape == p.train_mesh.shape


def test_planned_placement_colocates_on_one_device(caplog):
  cfg = tiny_config()  # planned; its colocated device count (4) is more than one device has
  caplog.set_level("INFO")
  one = place_stages(cfg, prompt_len=12, devices=jax.devices()[:1])
  assert one.mode == "colocated" and one.shares_devices
  assert one.rollout_mesh.devices.size == one.train_mesh.devices.size == 1
  assert "one cpu device cannot be split" in caplog.text


def test_published_weights_land_on_the_rollout_mesh(tmp_path):
  cfg = tiny_config(**{"placement.mode": "disaggregated", "eval.every": 0})  # 4 + 4 devices
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  (worker,) = controller.initial_workers  # sync: one worker over the 4 rollout devices
  controller.run(until=1)
  version, params = controller.weights.latest()
  rollout = worker.engine
  if rollout.version != version:  # stopped before it pulled the last one: as it would have
    rollout.update_weights(params, version)
  rollout_devices = set(rollout.mesh.devices.flat)
  train_devices = set(controller.learner.mesh.devices.flat)
  assert len(rollout_devices) == 4 and not rollout_devices & train_devices
  for name, array in jax.tree_util.tree_leaves_with_path(rollout.params):
    assert set(array.sharding.device_set) == rollout_devices, name
  for name, array in jax.tree_util.tree_leaves_with_path(controller.learner.params):
    assert set(array.sharding.device_set) == train_devices, name
  # Rollout layout: no fsdp, weights replicated over `data`; training shards embed over fsdp.
  emb_rollout = rollout.params["embed_vd"]
  emb_train = controller.learner.params["embed_vd"]
  assert {s.data.shape for s in emb_rollout.addressable_shards} == {emb_rollout.shape}
  assert {s.data.shape for s in emb_train.addressable_shards} == {
    (emb_train.shape[0], emb_train.shape[1] // 4)
  }
  np.testing.assert_array_equal(np.asarray(emb_rollout), np.asarray(emb_train))


def test_resume_reproduces_the_next_step(tmp_path):
  # With a KL term: its reference is the warmed-up policy of step 0, which every checkpoint
  # keeps, so the resumed run's KL is the uninterrupted run's.
  run = {"checkpoint.every": 1, "checkpoint.max_to_keep": 4, "eval.every": 0}
  run["train.loss.kl_weight"] = 0.05
  full = tiny_config(**{"train.steps": 3, **run})
  job.run(full, str(tmp_path / "full"), show_progress=False)
  with pytest.raises(ConfigError, match="resume=True"):  # existing checkpoints need resume
    job.run(full, str(tmp_path / "full"), show_progress=False)
  first = tiny_config(**{"train.steps": 2, **run})
  job.run(first, str(tmp_path / "resumed"), show_progress=False)
  resumed = tiny_config(**{"train.steps": 3, "resume": True, **run})
  job.run(resumed, str(tmp_path / "resumed"), show_progress=False)

  def step3(workdir):
    rows = [
      r
      for r in read_metrics(str(tmp_path / workdir / "metrics.jsonl"))
      if r["kind"] == "train" and r["step"] == 3
    ]
    assert len(rows) == 1
    return rows[0]

  a, b = step3("full"), step3("resumed")
  keys = ("reward_mean", "response_length", "loss", "grad_norm", "clip_frac", "ratio_mean", "kl")
  for key in keys:
    assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
  # Every checkpoint holds the reference: step 0's policy (after the warm-up), and the resumed
  # run's is the uninterrupted run's (a resume without it pulled towards the initial weights).
  read = ocp.StandardCheckpointer()

  for workdir in ("full", "resumed"):
    checkpoints = Checkpointer(str(tmp_path / workdir / "checkpoints"), max_to_keep=4)
    assert all(checkpoints.has_reference(step) for step in range(4))
    checkpoints.close()

  def item(workdir, step, name):
    return jax.tree.leaves(read.restore(tmp_path / workdir / "checkpoints" / str(step) / name))

  pairs = [
    (item("full", 0, "params"), item("full", 0, "reference")),
    (item("full", 3, "reference"), item("resumed", 3, "reference")),
  ]
  for want, got in pairs:
    for x, y in zip(want, got, strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # A resume with another group size or model is refused, naming what differs.
  again = {**run, "train.steps": 4, "resume": True}
  with pytest.raises(ConfigError, match=r"config.rollout.group_size is 8.*group_size=4"):
    job.run(tiny_config(**again, **{"rollout.group_size": 8}), str(tmp_path / "full"))
  with pytest.raises(ConfigError, match=r"checkpoints/3 does not fit this run's model"):
    job.run(tiny_config(**again, **{"model.mlp_dim": 256}), str(tmp_path / "full"))


def test_a_refused_or_failed_run_leaves_nothing_open(tmp_path, monkeypatch):
  """A process that runs job after job (a notebook, these tests) keeps nothing of one that
  failed: a workdir of checkpoints without `resume` is refused before anything is built, and a
  run whose loop raises closes its task, its metrics writer (TensorBoard's writer holds a
  thread and a pipe) and its checkpoint manager (each refused or failed run kept them), and
  its learner compiles nothing more ahead (its threads went on compiling)."""
  cfg = tiny_config(**{"train.steps": 1, "eval.every": 0, "checkpoint.every": 1})
  job.run(cfg, str(tmp_path / "done"), show_progress=False)
  built = []
  with monkeypatch.context() as m:
    m.setattr(job, "build_controller", lambda *args, **kwargs: built.append(args))
    with pytest.raises(ConfigError, match="resume=True"):
      job.run(cfg, str(tmp_path / "done"), show_progress=False)
  assert built == []
  closed = []
  for cls in (Controller, MetricsWriter, Checkpointer):

    def close(self, _close=cls.close, _name=cls.__name__):
      closed.append(_name)
      _close(self)

    monkeypatch.setattr(cls, "close", close)

  def fail(self, until=None):
    raise RuntimeError("the loop failed")

  monkeypatch.setattr(Controller, "run", fail)
  stop_compiling = Learner.stop_compiling_ahead
  monkeypatch.setattr(
    Learner, "stop_compiling_ahead", lambda self: closed.append("Learner") or stop_compiling(self)
  )
  with pytest.raises(RuntimeError, match="the loop failed"):
    job.run(cfg, str(tmp_path / "failed"), show_progress=False)
  # The first Checkpointer: the workdir's check for checkpoints, before the controller's.
  assert sorted(closed) == [
    "Checkpointer", "Checkpointer", "Controller", "Learner", "MetricsWriter"
  ]  # fmt: skip


def test_mesh_sizes_that_do_not_fit_are_reported():
  with pytest.raises(ConfigError, match=r"rollout_devices \+ config.placement.train_devices"):
    make_placement(tiny_config("fixed", **{"placement.rollout_devices": 6}).placement)
  with pytest.raises(ConfigError, match="config.placement.train_mesh"):
    make_placement(tiny_config("fixed", **{"placement.train_mesh.fsdp": 3}).placement)


def test_batch_that_does_not_split_is_reported(tmp_path):
  # Into updates of whole micro-batches: when the config is converted.
  with pytest.raises(ConfigError, match="config.train.micro_batch_size=5"):
    tiny_config(**{"train.micro_batch_size": 5})
  # Micro-batches over the training mesh's batch axes (fsdp 4 here): once the mesh is built.
  cfg = tiny_config("fixed", **{"train.micro_batch_size": 2})
  with pytest.raises(ConfigError, match="micro_batch_size=2"):
    job.build_controller(cfg, str(tmp_path), show_progress=False)


def test_nan_loss_is_reported_with_step_and_not_applied(tmp_path, caplog):
  cfg = tiny_config(**{"eval.every": 0})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  controller.task.reward = lambda record, response: float("nan")
  before = jax.tree.map(np.asarray, controller.learner.params)
  with caplog.at_level("WARNING"):
    controller.run(until=1)
  (metrics,) = [r for r in read_metrics(controller.writer.path) if r["kind"] == "train"]
  assert metrics["skipped"] == cfg.train.updates_per_step
  assert "Step 0: non-finite loss" in caplog.text and "update was skipped" in caplog.text
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(controller.learner.params), strict=True):
    np.testing.assert_array_equal(x, np.asarray(y))


def test_malformed_dataset_row_is_reported_with_file_and_line(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
  cfg = tiny_config(
    **{"task.name": "gsm8k", "task.path": str(path), "tokenizer": "byte", "model.vocab_size": 320}
  )
  with pytest.raises(ValueError, match=rf"{path}:2: .*answer"):
    job.build_controller(cfg, str(tmp_path / "run"), show_progress=False)


def test_prompts_the_tokenizer_cannot_encode_are_refused_naming_both_settings(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"question": "What is 1+1?", "answer": "#### 2"}\n')
  cfg = tiny_config(**{"task.name": "gsm8k", "task.path": str(path)})  # the char tokenizer
  with pytest.raises(ConfigError, match=r"config.tokenizer='char' cannot encode the prompts of "
                     r"config.task.name='gsm8k': CharTokenizer cannot encode 'W'"):  # fmt: skip
    job.build_controller(cfg, str(tmp_path / "run"), show_progress=False)


@pytest.mark.parametrize("stage", ["train", "rollout"])
def test_a_mesh_that_does_not_divide_the_model_is_refused_naming_it(tmp_path, stage):
  """The tiny model's 2 KV heads over a tensor axis of 4: refused before anything is built, the
  error naming the mesh's key (the training mesh also holds the eval engine)."""
  cfg = tiny_config("fixed", **{f"placement.{stage}_mesh.tensor": 4})
  with pytest.raises(ConfigError, match=rf"config.placement.{stage}_mesh = .*'tensor': 4.*"
                     r"'kv_heads'"):  # fmt: skip
    job.build_controller(cfg, str(tmp_path), show_progress=False)


def test_workers_that_do_not_split_the_planned_rollout_devices_are_refused(tmp_path):
  cfg = tiny_config(**{"loop.rollout_workers": 3})  # planned: 4 rollout devices of 8
  with pytest.raises(ConfigError, match=r"rollout_workers=3 does not divide the 4 rollout "
                     r"devices the planner chose .*rollout_workers=0"):  # fmt: skip
    job.build_controller(cfg, str(tmp_path), show_progress=False)


def test_async_splits_the_rollout_devices_into_two_workers_only_of_whole_replicas(tmp_path):
  """6 rollout devices of tensor 2: two workers of 3 devices could not hold a replica each, so
  the loop's default is one worker of all 6 (it was two, and the job refused to start)."""
  cfg = tiny_config(
    "fixed",
    **{
      "placement.rollout_devices": 6,
      "placement.train_devices": 2,
      "placement.rollout_mesh.tensor": 2,
      "loop.mode": "async",
    },
  )
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  try:
    (worker,) = controller.initial_workers
    assert dict(worker.engine.mesh.shape) == {"data": 3, "fsdp": 1, "tensor": 2, "expert": 1}
  finally:
    controller.close()
  even = tiny_config("fixed", **{"placement.rollout_mesh.tensor": 2, "loop.mode": "async"})
  assert worker_count(even, 4, 2) == 2 and worker_count(even, 6, 2) == 1
  assert worker_count(even, 6, 1) == 2


@dataclasses.dataclass(frozen=True)
class _Device:
  platform: str
  id: int


def _placement(rollout, train):
  mesh = lambda devices: types.SimpleNamespace(devices=np.array(devices))  # noqa: E731
  return types.SimpleNamespace(rollout_mesh=mesh(rollout), train_mesh=mesh(train))


def test_auto_loop_mode_is_async_only_where_the_stages_have_hardware_of_their_own():
  gpus = [_Device("gpu", i) for i in range(8)]
  cpus = [_Device("cpu", i) for i in range(8)]
  auto = lambda **o: job.resolve_loop_mode(tiny_config(**o), placement)  # noqa: E731
  placement = _placement(gpus[:4], gpus[4:])
  assert auto() == "async"
  assert auto(**{"loop.mode": "sync"}) == "sync"
  placement = _placement(gpus, gpus)  # colocated
  assert auto() == "sync"
  assert auto(**{"loop.mode": "async"}) == "async"  # asked for: not second-guessed
  placement = _placement(cpus[:4], cpus[4:])  # simulated devices sharing this machine's cores
  assert auto() == "sync"
  assert auto(**{"loop.backend": "ray", "loop.ray_pin_cores": True}) == "async"


def test_pinned_cores_split_in_halves_and_need_two(monkeypatch):
  from jaxrl.rl.ray_backend import core_split

  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 2, 7, 3})
  assert core_split() == ([2, 3], [5, 7])
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
  with pytest.raises(ConfigError, match="at least 2 CPU cores"):
    core_split()


def test_a_page_budget_that_cannot_hold_one_request_is_refused(tmp_path):
  """The workers would refuse every such request and crash on it, again after each restart,
  until the run stops with no worker (73 s in the run that found it)."""
  cfg = tiny_config(**{"rollout.paged.page_size": 2, "rollout.paged.num_pages": 6})
  want = (
    r"config.rollout.paged.num_pages=6 pages of config.rollout.paged.page_size=2 tokens cannot "
    r"hold one request of this run: the longest of the task's first prompts \((\d+) tokens\) and "
    r"a response of config.rollout.sampling.max_new_tokens=8 may cache (\d+) tokens, (\d+) "
    r"pages .* at least \3"
  )
  with pytest.raises(ConfigError, match=want):
    job.build_controller(cfg, str(tmp_path), show_progress=False)
  game = load_config(os.path.join(REPO, "configs", "grpo_agent.py"), "test", {
    "rollout.paged.page_size": 2, "rollout.paged.num_pages": 24, "env.max_tokens": 96,
  })  # fmt: skip
  with pytest.raises(ConfigError, match=r"a trajectory of up to 96 tokens \(config.env.max_tokens"
                     r"=96\) may cache 95 tokens, 48 pages"):  # fmt: skip
    job.build_controller(game, str(tmp_path / "game"), show_progress=False)


@pytest.mark.parametrize("limit", ["max_seq_len", "num_pages"])
def test_a_training_prompt_too_long_for_the_model_is_skipped_and_counted(tmp_path, caplog, limit):
  """The workers would refuse it (no room for a token, or for its response in the page
  budget): it must not crash them, again and again, until the run stops; it is skipped with a
  warning and the next prompt released. 2 pages of 16 hold the task's prompts and responses."""
  pages = {"rollout.paged.num_pages": 2} if limit == "num_pages" else {}
  cfg = tiny_config(**{"warmup.steps": 0, "eval.every": 0, **pages})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  records = [dict(r) for r in next(controller.loader)]
  max_seq_len = controller.rollout.model.config.max_seq_len
  # Past the page budget: 26 prompt ids (27 with a BOS) and 8 new tokens cache 33 or more.
  length = max_seq_len + 5 if limit == "max_seq_len" else 26
  records[1]["prompt"] = "7" * length
  records[1].pop("messages", None)
  controller.prompts.extend(records)
  controller._release()
  assert controller.counters["prompts_too_long"] == 1
  assert "Skipped a training prompt" in caplog.text
  why = "max_seq_len=64" if limit == "max_seq_len" else "num_pages=2 pages of 16 hold"
  assert why in caplog.text
  released = [g.records[0].prompt_ids for g in controller.groups.values()]
  assert len(released) == cfg.rollout.prompts_per_step  # the next batch's first took its place
  assert max(map(len, released)) < 20
  controller.close()


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"checkpoint.hf_every": 1}, r"config.checkpoint.hf_every=1 exports a run that started"),
    ({"rollout.sampling.max_new_tokens": 500}, r"max_new_tokens=500 leaves no room"),
  ],
)
def test_settings_that_would_do_nothing_are_refused(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    job.build_controller(tiny_config(**overrides), str(tmp_path), show_progress=False)
