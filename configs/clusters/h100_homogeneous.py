"""Homogeneous cluster: 8 nodes of 8 H100 (NVLink inside a node, 400 Gb/s per GPU between).

python launch/plan.py --cluster configs/clusters/h100_homogeneous.py --model qwen3-8b
"""

import ml_collections


def get_config(arg=None):
  del arg
  return ml_collections.ConfigDict(
    {
      "name": "h100-homogeneous",
      "pools": [
        {
          "name": "h100",
          "accelerator": "H100",
          "nodes": 8,
          "devices_per_node": 8,
          "inter_node_GBps": 50.0,
        },
      ],
    }
  )
