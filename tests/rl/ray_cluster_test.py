"""A plan run on a Ray cluster: pools found from the nodes' resources, clear errors for a spec
the cluster does not hold, and, on a two-node rig of two fake accelerator types, the learner's
processes and the rollout instances started on the nodes of the pools the plan chose."""

import collections
import dataclasses
import os
import time

import pytest

from jaxrl.config import ConfigError
from jaxrl.rl.ray_cluster import (
  PoolNodes,
  check_cluster,
  cluster_from_ray,
  placement_for_job,
  plan_placement,
  pool_resource,
  ray_pools,
  replan_placement,
)
from jaxrl.scheduler.cluster import load_cluster
from jaxrl.scheduler.plan import Plan, RolloutStage, TrainStage

from .async_test import async_config  # noqa: TID252

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RIG = os.path.join(REPO, "configs", "clusters", "ray_rig.py")
AXES = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}


def node(alive=True, **resources):
  return {"Alive": alive, "Resources": resources}


def rig_plan(train_devices=1, train_mesh=None) -> Plan:
  """Training on the fast pool, two one-device rollout instances on the cheap one."""
  return Plan(
    cluster="ray-rig", model="tiny", mode="async", max_staleness=1, samples_per_step=16,
    train=TrainStage({"fast": train_devices}, "H100", train_devices,
                     train_mesh or dict(AXES), 0.1, 0.1),
    rollout=(RolloutStage("cheap", "L4", 2, dict(AXES), 8, 100.0, 0.01, 0.1),),
    cycle_seconds=1.0, throughput_samples_per_s=16.0, cost_per_hour=1.0,
    stage_seconds={}, bottleneck="train", devices_used={"fast": 1, "cheap": 2},
  )  # fmt: skip


def test_pools_come_from_the_nodes_resources_and_a_missing_pool_is_named():
  nodes = [
    node(**{pool_resource("fast"): 1.0, "CPU": 1.0}),
    node(**{pool_resource("cheap"): 4.0, "GPU": 4.0}),
    node(alive=False, **{pool_resource("cheap"): 4.0}),
  ]
  pools = ray_pools(nodes)
  assert pools == {"fast": PoolNodes((1,), None), "cheap": PoolNodes((4,), "GPU")}
  cluster = load_cluster(RIG)
  check_cluster(cluster, pools)  # the rig's spec: one node of each
  with pytest.raises(ConfigError, match="pool 'cheap' wants 1 node.*has 0.*jaxrl-pool-cheap"):
    check_cluster(cluster, {"fast": pools["fast"]})
  # GPU nodes: a process also asks Ray for its GPUs, so it gets devices of its own.
  placed = plan_placement(rig_plan(), 1, pools)
  assert placed.learner[0].actor_options == {"num_cpus": 0, "resources": {"jaxrl-pool-fast": 1}}
  assert [s.actor_options.get("num_gpus") for s in placed.rollout] == [1, 1]
  with pytest.raises(ConfigError, match="num_processes=3: the plan trains on 4 devices"):
    plan_placement(rig_plan(train_devices=4, train_mesh={**AXES, "fsdp": 4}), 3, pools)
  # Rollout instances of tensor 2 as gangs of two one-device processes (`rollout.num_processes`).
  wide = dataclasses.replace(rig_plan(), rollout=(
    dataclasses.replace(rig_plan().rollout[0], mesh={**AXES, "tensor": 2}),
  ))  # fmt: skip
  placed = plan_placement(wide, 1, pools, rollout_processes=2)
  assert [(s.processes, s.devices, s.mesh["tensor"]) for s in placed.rollout] == [(2, 1, 2)] * 2
  assert placed.rollout[0].actor_options["resources"] == {"jaxrl-pool-cheap": 1}
  with pytest.raises(ConfigError, match=r"rollout\.num_processes=3: .* have 2 devices"):
    plan_placement(wide, 1, pools, rollout_processes=3)


def test_the_spec_can_come_from_the_nodes_own_resources():
  """`loop.ray_cluster="ray"`: pools and accelerator types read from the nodes."""
  accel = "jaxrl-accelerator-{}".format
  nodes = [
    node(**{pool_resource("train"): 8.0, accel("H100"): 1.0, "GPU": 8.0}),
    node(**{pool_resource("train"): 8.0, accel("H100"): 1.0, "GPU": 8.0}),
    node(**{pool_resource("gen"): 4.0, accel("L4"): 1.0, "GPU": 4.0}),
  ]
  cluster = cluster_from_ray(ray_pools(nodes))
  assert {(p.name, p.accelerator, p.nodes, p.devices_per_node) for p in cluster.pools} == {
    ("train", "H100", 2, 8),
    ("gen", "L4", 1, 4),
  }
  unnamed = [node(**{pool_resource("gen"): 4.0})]
  with pytest.raises(ConfigError, match="pool 'gen': its nodes name no accelerator"):
    cluster_from_ray(ray_pools(unnamed))
  with pytest.raises(ConfigError, match="unknown accelerator 'Z9'"):
    cluster_from_ray(ray_pools([node(**{pool_resource("x"): 1.0, accel("Z9"): 1.0})]))
  with pytest.raises(ConfigError, match="no node carries"):
    cluster_from_ray({})


@pytest.fixture(scope="module")
def rig():
  """Two raylets on this machine: one node of the `fast` pool (1 fake H100), one of the
  `cheap` pool (4 fake L4); each actor process takes simulated CPU devices."""
  ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")
  from ray.cluster_utils import Cluster

  cluster = Cluster(
    initialize_head=True,
    head_node_args={"num_cpus": 1, "resources": {pool_resource("fast"): 1}},
  )
  cheap = cluster.add_node(num_cpus=1, resources={pool_resource("cheap"): 4})
  ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
  yield ray, {"fast": cluster.head_node.node_id, "cheap": cheap.node_id, "cluster": cluster,
              "cheap_node": cheap}  # fmt: skip
  ray.shutdown()
  cluster.shutdown()


@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_stages_start_on_the_nodes_of_the_pools_the_plan_chose(rig):
  ray, node_of = rig
  from jaxrl.rl.ray_backend import RayWeightStore
  from jaxrl.rl.ray_learner import RayLearner
  from jaxrl.rl.ray_rollout import RayWorker

  cfg = async_config(**{"loop.backend": "ray", "loop.ray_cluster": RIG})
  # The job's own path: the spec checked against the rig, planned, placed.
  placed = placement_for_job(cfg, 16, ray.nodes())
  plan = placed.plan
  assert [s.pool for s in placed.learner] == list(plan.train.pools)
  assert sorted(s.pool for s in placed.rollout) == sorted(
    r.pool for r in plan.rollout for _ in range(r.instances)
  )
  # A plan that uses both pools: the learner on the fast node, the workers on the cheap one.
  placed = plan_placement(rig_plan(), 1, ray_pools(ray.nodes()))
  learner = RayLearner(
    cfg, placed.train_mesh, rank_options=[s.actor_options for s in placed.learner]
  )
  store = RayWeightStore()
  workers = [
    RayWorker(f"w{i}", cfg, store, num_devices=s.devices, mesh_axes=s.mesh,
              actor_options=s.actor_options)
    for i, s in enumerate(placed.rollout)
  ]  # fmt: skip
  try:
    assert learner.node_ids() == [node_of["fast"]]
    assert [w.node_id() for w in workers] == [node_of["cheap"]] * 2
    assert dataclasses.asdict(placed.rollout[0])["mesh"] == {**AXES}
  finally:
    learner.kill()
    for w in workers:
      w.kill()


def test_a_node_joining_or_leaving_is_re_planned_and_a_pool_lost_is_a_clear_error():
  """`replan_placement`: nothing while the nodes are as planned; a node joining is re-planned
  (`scheduler.replan.decide`: the new plan if it repays the switch, else the kept one) for the
  cluster as it is now; the only rollout pool's node lost leaves no plan: a clear error."""
  cfg = async_config(**{"loop.backend": "ray", "loop.ray_cluster": RIG})
  nodes = [
    node(**{pool_resource("fast"): 1.0}),
    node(**{pool_resource("cheap"): 4.0}),
  ]
  placed = placement_for_job(cfg, 16, nodes)
  assert {p.name: p.nodes for p in placed.cluster.pools} == {"fast": 1, "cheap": 1}
  assert replan_placement(cfg, 16, placed, nodes) is None
  joined = [*nodes, node(**{pool_resource("cheap"): 4.0})]
  replanned, decision = replan_placement(cfg, 16, placed, joined)
  assert {p.name: p.nodes for p in replanned.cluster.pools} == {"fast": 1, "cheap": 2}
  assert replanned.plan is decision.plan and not decision.forced
  assert len(replanned.rollout) == sum(r.instances for r in decision.plan.rollout) >= 1
  assert replan_placement(cfg, 16, replanned, joined) is None  # planned for it now
  lost = [n for n in nodes if pool_resource("fast") in n["Resources"]]
  with pytest.raises(RuntimeError, match="no plan runs on what is left.*resume=True"):
    replan_placement(cfg, 16, placed, lost)


@pytest.mark.ray
@pytest.mark.slow  # a job on the rig with a node added and then lost: 1-2 minutes on 2 cores
@pytest.mark.xdist_group("ray")
def test_a_node_lost_mid_run_is_re_planned_and_loses_no_sample(rig, tmp_path):
  """A second node of the cheap pool joins before the job starts (the job re-plans for it), and
  the cheap node holding most rollout workers is lost mid-run (its raylet stopped, its
  processes with it). Its workers' requests go on elsewhere and the controller re-plans for the
  nodes left; if the learner (and the store beside it) was there too, the loop finds it gone
  within seconds and the run goes on from the last checkpoint with a new learner and store, as
  `job.run` does. Every group is trained once. (The last test of the module: the
  rig keeps one cheap node, whichever was left.)"""
  ray, node_of = rig
  from jaxrl.rl import job
  from jaxrl.rl.backends import LearnerLost

  from .async_test import Ledger  # noqa: TID252

  cluster = node_of["cluster"]
  extra = cluster.add_node(num_cpus=1, resources={pool_resource("cheap"): 4})
  cluster.wait_for_nodes()
  overrides = {"loop.backend": "ray", "loop.ray_cluster": RIG, "train.steps": 6}
  cfg = async_config(**overrides, **{"checkpoint.every": 1, "resume": True})
  ledger = Ledger(cfg.loop.max_staleness)
  lost, counters, learner_lost = [], collections.Counter(), []

  def lose_a_rollout_node(c):
    if lost and not learner_lost and c.counters["cluster_replans"] < 2:
      # Workers decode on while the hook waited: the last steps' groups may all be ready, and
      # the run could end before the loop's next look at the cluster (`CLUSTER_CHECK_S`).
      time.sleep(1.0)
    if c.state.step == 2 and not lost:
      where = [w.node_id() for w in c.workers.values()]
      victim = max((node_of["cheap_node"], extra), key=lambda x: where.count(x.node_id))
      lost.append(where.count(victim.node_id))
      cluster.remove_node(victim)
      # Until Ray's node list says so, the loop cannot re-plan for it; the run's last steps
      # could otherwise end before then (the assertion on the re-plans below).
      deadline = time.monotonic() + 60
      while any(n["NodeID"] == victim.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "Ray still lists the removed node as alive"
        time.sleep(0.1)

  while True:
    controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
    latest = controller.checkpointer.latest_step()
    if latest is None:
      controller.save()
    else:  # what the lost learner trained after its checkpoint is undone with it
      controller.restore(latest)
      ledger.trained = {g: s for g, s in ledger.trained.items() if s < latest}
      ledger.prefix = {}
    ledger.attach(controller)
    controller.hooks.append(lose_a_rollout_node)
    try:
      controller.run()
      break
    except LearnerLost:
      learner_lost.append(controller.state.step)
      assert len(learner_lost) == 1, learner_lost
    finally:
      counters.update(controller.counters)
      controller.close()
      controller.learner.kill()
  ledger.check(controller, cfg)
  # The node joining, then the node lost: re-planned by the loop, or, where the learner was
  # there (the plan may train on the cheap pool), by the new controller's plan for the nodes
  # left (before the loop asked the backend whether its learner was gone, such a run could
  # wait forever for weights the lost learner never published).
  assert counters["cluster_replans"] >= (1 if learner_lost else 2), (counters, learner_lost)
  # Its workers were lost (unless the learner went with them first: then all were replaced).
  lost_workers = counters["workers_lost"] + counters["workers_crashed"]
  assert lost[0] >= 1 and (learner_lost or lost_workers >= 1), counters
