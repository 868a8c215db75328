"""TPU + GPU mix: a v5p slice (16 hosts of 4 chips on ICI) and a v5e pool next to 2 nodes of 8
H100. One JAX program cannot mix them, so each stage stays on one type.

  python launch/plan.py --cluster configs/clusters/tpu_gpu_mix.py --model qwen3-8b
"""

import ml_collections


def get_config(arg=None):
  del arg
  return ml_collections.ConfigDict(
    {
      "name": "tpu-gpu-mix",
      "pools": [
        # A TPU slice's hosts share the ICI torus: inter-host bandwidth is ICI, not DCN.
        {
          "name": "v5p",
          "accelerator": "v5p",
          "nodes": 16,
          "devices_per_node": 4,
          "inter_node_GBps": 150.0,
        },
        {
          "name": "v5e",
          "accelerator": "v5e",
          "nodes": 8,
          "devices_per_node": 8,
          "inter_node_GBps": 50.0,
        },
        {
          "name": "h100",
          "accelerator": "H100",
          "nodes": 2,
          "devices_per_node": 8,
          "inter_node_GBps": 50.0,
        },
      ],
      "cross_pool_GBps": 12.5,
    }
  )
