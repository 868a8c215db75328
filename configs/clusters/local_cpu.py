"""This machine: 8 simulated CPU devices in one process (`jax_num_cpu_devices`). Bandwidth and
FLOP/s of the `cpu` entry are measured when the cluster loads; `arg` = "static" keeps the
catalog's stored measurement instead (deterministic, for tests).

  python launch/plan.py --cluster configs/clusters/local_cpu.py --model tiny
"""

import ml_collections


def get_config(arg=None):
  return ml_collections.ConfigDict(
    {
      "name": "local-cpu",
      "pools": [
        # One "node" of 8 devices sharing memory; devices talk through memory copies.
        {
          "name": "cpu",
          "accelerator": "cpu",
          "nodes": 1,
          "devices_per_node": 8,
          "inter_node_GBps": 10.0,
        },
      ],
      "calibrate_cpu": arg != "static",
    }
  )
