"""Supervised warm-up: next-token cross-entropy on (prompt, answer) pairs.

RL from a random initialisation never sees a reward; a short supervised warm-up gives the policy
a non-zero success rate for RL to improve on. It trains the learner's parameters in place with
an optimizer of its own, so the RL optimizer starts fresh.

Glossary: b sequences, t target positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.train.learner import Learner
from jaxrl.train.losses import chunked_token_logprobs
from jaxrl.train.optimizer import (
  apply_if_finite,
  optimizer_shardings,
  training_compiler_options,
)


class SupervisedTrainer:
  """Cross-entropy steps on `learner.params`."""

  def __init__(self, learner: Learner, learning_rate: float):
    self.learner = learner
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))
    # The learner's layout in and out, so the RL updates after the warm-up compile once.
    opt_shardings = optimizer_shardings(self.optimizer, learner.params, learner.param_shardings)
    self.opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(learner.params)
    replicated = jax.sharding.NamedSharding(learner.mesh, jax.sharding.PartitionSpec())
    self._step = jax.jit(
      self._step_impl,
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

  def _step_impl(self, params, opt_state, tokens_bt, mask_bt):
    def loss_fn(p):
      # The learner's chunked log-probs, at temperature 1 (`_token_stats` uses the rollout's).
      hidden_btd, _ = self.learner.model.apply(
        p, tokens_bt[:, :-1], return_hidden=True,
        activation_sharding=self.learner.activation_sharding,
        kernel_mesh=self.learner.kernel_mesh,
      )  # fmt: skip
      logp_bt, _ = chunked_token_logprobs(
        hidden_btd,
        self.learner.model.lm_head(p),
        tokens_bt[:, 1:],
        vocab_limit=self.learner.model.config.vocab_limit,
        chunk=self.learner.logprob_chunk,
        vocab_shards=self.learner.vocab_shards,
        logit_softcap=self.learner.model.config.final_logit_softcap,
      )
      return -jnp.sum(logp_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return apply_if_finite(self.optimizer, params, opt_state, grads, loss, {})
