"""The RL loop: placement of stages on meshes, the controller, weight store and checkpoints."""

from jaxrl.rl.controller import Controller, ControllerState
from jaxrl.rl.placement import Placement, make_placement
from jaxrl.rl.weights import WeightStore

__all__ = [
  "Controller",
  "ControllerState",
  "Placement",
  "WeightStore",
  "make_placement",
]
