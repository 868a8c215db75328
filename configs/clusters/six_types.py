"""Six accelerator types in equal shares of `arg` devices (default 256), for the planner's scale
benchmark (launch/bench.py plan). Two of the pools are preemptible.

  python launch/plan.py --cluster configs/clusters/six_types.py:1024 --model qwen3-8b
"""

import ml_collections

# accelerator, devices per node, inter-node GB/s per device, preemptible
TYPES = (
  ("H100", 8, 50.0, False),
  ("H200", 8, 50.0, True),
  ("A100-80GB", 8, 25.0, False),
  ("L40S", 4, 12.5, False),
  ("L4", 4, 6.25, True),
  ("MI300X", 8, 50.0, False),
)


def get_config(arg=None):
  devices = 256 if arg is None else int(arg)
  share = devices // len(TYPES)
  pools = [
    {
      "name": name.lower(),
      "accelerator": name,
      "nodes": max(1, share // per_node),
      "devices_per_node": per_node,
      "inter_node_GBps": bw,
      "preemptible": spot,
    }
    for name, per_node, bw, spot in TYPES
  ]
  return ml_collections.ConfigDict({"name": f"six-types-{devices}", "pools": pools})
