"""Supervised warm-up: next-token cross-entropy on (prompt, answer) pairs.

RL from a random initialisation never sees a reward; a short supervised warm-up gives the policy
a non-zero success rate for RL to improve on. It trains the learner's parameters in place with
an optimizer of its own, so the RL optimizer starts fresh.

Glossary: b sequences, t target positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.compile_ahead import shared_function
from jaxrl.model import Model
from jaxrl.train.learner import Learner
from jaxrl.train.losses import chunked_token_logprobs
from jaxrl.train.optimizer import (
  apply_if_finite,
  optimizer_shardings,
  training_compiler_options,
)


# One transformation per learning rate in a process, so that trainers of equal settings share
# their step's trace and program (`SupervisedStep`, `compile_ahead.shared_function`).
@functools.cache
def warmup_optimizer(learning_rate: float) -> optax.GradientTransformation:
  """AdamW at `learning_rate` after clipping the gradients' global norm to 1."""
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))


@dataclasses.dataclass(frozen=True)
class SupervisedStep:
  """What a warm-up step computes with besides its arguments (hashable, compared by value):
  the learner's model, residual layout, kernel mesh, log-prob chunk and vocabulary split, and
  the warm-up's optimizer. Its `step` is jitted through `shared_function`: a job built again in
  the process (a resume, a restart after a fault, the tests' many jobs) runs the warm-up with
  the program the first one compiled."""

  model: Model
  activation_sharding: jax.sharding.NamedSharding | None
  kernel_mesh: jax.sharding.Mesh | None
  logprob_chunk: int
  vocab_shards: int
  optimizer: optax.GradientTransformation

  def step(self, params, opt_state, tokens_bt, mask_bt):
    """One AdamW step on the mean cross-entropy of the targets `mask_bt` marks."""

    def loss_fn(p):
      # The learner's chunked log-probs, at temperature 1 (the RL loss uses the rollout's).
      hidden_btd, _ = self.model.apply(
        p, tokens_bt[:, :-1], return_hidden=True,
        activation_sharding=self.activation_sharding, kernel_mesh=self.kernel_mesh,
      )  # fmt: skip
      logp_bt, _ = chunked_token_logprobs(
        hidden_btd,
        self.model.lm_head(p),
        tokens_bt[:, 1:],
        vocab_limit=self.model.config.vocab_limit,
        chunk=self.logprob_chunk,
        vocab_shards=self.vocab_shards,
        logit_softcap=self.model.config.final_logit_softcap,
      )
      return -jnp.sum(logp_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return apply_if_finite(self.optimizer, params, opt_state, grads, loss, {})


class SupervisedTrainer:
  """Cross-entropy steps on `learner.params`."""

  def __init__(self, learner: Learner, learning_rate: float):
    self.learner = learner
    self.optimizer = warmup_optimizer(float(learning_rate))
    # The learner's layout in and out, so the RL updates after the warm-up compile once.
    opt_shardings = optimizer_shardings(self.optimizer, learner.params, learner.param_shardings)
    self.opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(learner.params)
    replicated = jax.sharding.NamedSharding(learner.mesh, jax.sharding.PartitionSpec())
    settings = SupervisedStep(
      learner.model, learner.activation_sharding, learner.kernel_mesh, learner.logprob_chunk,
      learner.vocab_shards, self.optimizer,
    )  # fmt: skip
    self._step = jax.jit(
      shared_function(SupervisedStep.step, settings),
      donate_argnums=(0, 1),
      out_shardings=(learner.param_shardings, opt_shardings, replicated),
      compiler_options=training_compiler_options(learner.mesh),
    )

  def step(self, tokens_bt: np.ndarray, mask_bt: np.ndarray) -> dict[str, jax.Array]:
    """One update; `mask_bt[:, i]` marks the targets (token i + 1) that are trained on."""
    self.learner.recall_lent()  # the step donates the parameters
    self.learner.params, self.opt_state, metrics = self._step(
      self.learner.params, self.opt_state, jnp.asarray(tokens_bt), jnp.asarray(mask_bt)
    )
    return metrics
