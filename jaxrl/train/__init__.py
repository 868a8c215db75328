"""The learner: token log-probs, advantages, policy losses, optimizer and the update step."""

from jaxrl.train.advantages import ADVANTAGE_MODES, group_advantages, zero_variance_groups
from jaxrl.train.learner import Learner, TrainBatch, apply_if_finite
from jaxrl.train.losses import LossConfig, kl_k3, policy_loss, token_logprobs
from jaxrl.train.optimizer import OptimizerConfig, make_optimizer, make_schedule
from jaxrl.train.routing import MoEConfig
from jaxrl.train.sft import SupervisedTrainer

__all__ = [
  "ADVANTAGE_MODES",
  "Learner",
  "LossConfig",
  "MoEConfig",
  "OptimizerConfig",
  "SupervisedTrainer",
  "TrainBatch",
  "apply_if_finite",
  "group_advantages",
  "kl_k3",
  "make_optimizer",
  "make_schedule",
  "policy_loss",
  "token_logprobs",
  "zero_variance_groups",
]
