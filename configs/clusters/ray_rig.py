"""The one-machine test rig for running a plan on Ray: two nodes of fake accelerators of two
types, each node a raylet of a local `ray.cluster_utils.Cluster` carrying its pool's resource
and 4 simulated CPU devices per process (`tests/rl/ray_cluster_test.py`). The planner should
train on the fast node and generate on the bandwidth-rich one.

  python launch/plan.py --cluster configs/clusters/ray_rig.py --model tiny
"""

import ml_collections


def get_config(arg=None):
  del arg
  return ml_collections.ConfigDict(
    {
      "name": "ray-rig",
      "pools": [
        {"name": "fast", "accelerator": "H100", "nodes": 1, "devices_per_node": 1},
        {"name": "cheap", "accelerator": "L4", "nodes": 1, "devices_per_node": 4},
      ],
      "cross_pool_GBps": 12.5,
    }
  )
