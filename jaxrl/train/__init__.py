"""The learner: token log-probs, advantages, policy losses, optimizer and the update step."""

from jaxrl.train.advantages import ADVANTAGE_MODES, group_advantages, zero_variance_groups
from jaxrl.train.batch import TrainBatch
from jaxrl.train.learner import Learner
from jaxrl.train.losses import LossConfig, kl_k3, policy_loss, token_logprobs
from jaxrl.train.optimizer import OptimizerConfig, apply_if_finite, make_optimizer, make_schedule
from jaxrl.train.packing import MicroBatch, PackLayout, pack_batch, pack_layout
from jaxrl.train.routing import MoEConfig
from jaxrl.train.sft import SupervisedTrainer

__all__ = [
  "ADVANTAGE_MODES",
  "Learner",
  "LossConfig",
  "MicroBatch",
  "MoEConfig",
  "OptimizerConfig",
  "PackLayout",
  "SupervisedTrainer",
  "TrainBatch",
  "apply_if_finite",
  "group_advantages",
  "kl_k3",
  "make_optimizer",
  "make_schedule",
  "pack_batch",
  "pack_layout",
  "policy_loss",
  "token_logprobs",
  "zero_variance_groups",
]
