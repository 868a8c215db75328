"""A few fast GPUs (2 nodes of 8 H100) plus many cheaper bandwidth-rich ones (16 nodes of 4
L40S and 8 nodes of 8 RTX 4090 on PCIe): the planner should train on the H100s and generate on
the rest, where HBM bandwidth per dollar is higher.

  python launch/plan.py --cluster configs/clusters/mixed_fast_cheap.py --model qwen3-8b
"""

import ml_collections


def get_config(arg=None):
  del arg
  return ml_collections.ConfigDict(
    {
      "name": "mixed-fast-cheap",
      "pools": [
        {
          "name": "h100",
          "accelerator": "H100",
          "nodes": 2,
          "devices_per_node": 8,
          "inter_node_GBps": 50.0,
        },
        {
          "name": "l40s",
          "accelerator": "L40S",
          "nodes": 16,
          "devices_per_node": 4,
          "inter_node_GBps": 12.5,
        },
        {
          "name": "rtx4090",
          "accelerator": "RTX4090",
          "nodes": 8,
          "devices_per_node": 8,
          "inter_node_GBps": 3.125,
        },
      ],
      "cross_pool_GBps": 12.5,
    }
  )
