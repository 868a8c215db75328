"""An on-demand pool (4 nodes of 8 H100) plus a preemptible pool (8 nodes of 8 A100-80GB at
spot prices) that may shrink or vanish: training stays on demand, rollout harvests the spot
pool. `arg` sets the spot pool's current node count (default 8).

  python launch/plan.py --cluster configs/clusters/ondemand_preemptible.py --model qwen3-8b
  python launch/simulate.py --cluster configs/clusters/ondemand_preemptible.py --model qwen3-8b
"""

import ml_collections


def get_config(arg=None):
  spot_nodes = 8 if arg is None else int(arg)
  return ml_collections.ConfigDict(
    {
      "name": "ondemand-preemptible",
      "pools": [
        {
          "name": "h100",
          "accelerator": "H100",
          "nodes": 4,
          "devices_per_node": 8,
          "inter_node_GBps": 50.0,
        },
        {
          "name": "a100-spot",
          "accelerator": "A100-80GB",
          "nodes": spot_nodes,
          "devices_per_node": 8,
          "inter_node_GBps": 25.0,
          "preemptible": True,
        },
      ],
      "cross_pool_GBps": 12.5,
    }
  )
