"""What the learner's jitted programs compute: log-probs, the loss of a micro-batch, the
micro-step that adds its gradients into sums, the step that applies them, and the padded
update (every micro-batch in one scan).

They are methods of a frozen `UpdatePrograms`, which holds everything they compute with
besides their arguments, so that the learner jits them through `shared_function`: learners of
equal settings in a process (a learner built again after a fault or on a resume, the tests'
many learners) share their traces and compiled programs, and each learner counts its own
shapes (`compile_ahead.ShapeRecord`).

Glossary: m micro-batches, b sequences (or packed rows), t target positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.model import ExpertParallel, Model, MoEInputs
from jaxrl.train import replica_sums
from jaxrl.train.losses import LossConfig, chunked_token_logprobs, policy_loss
from jaxrl.train.optimizer import apply_if_finite
from jaxrl.train.packing import MicroBatch, input_positions


def _add_gradient(sum_, grad):
  """`sum_ + grad`, added in the wider of the two dtypes and stored in `sum_`'s (bf16 sums of
  `grad_accum_dtype` round once per micro-batch, not the gradient before adding)."""
  wide = jnp.promote_types(sum_.dtype, grad.dtype)
  return (sum_.astype(wide) + grad.astype(wide)).astype(sum_.dtype)


@dataclasses.dataclass(frozen=True)
class UpdatePrograms:
  """A learner's settings that its programs compute with (hashable, compared by value).

  Attributes:
    model: the policy (its blocks' scan already fitted to the mesh).
    mesh: the training mesh.
    expert_parallel: the MoE layers' expert-parallel path, or None (reference dispatch).
    capacity: MoE with an expert capacity: padding positions take none of it, drops counted.
    activation_sharding: the residual stream's layout between blocks, or None (XLA's choice).
    kernel_mesh: the mesh the attention kernels split over (`jaxrl.sharding.kernel_mesh`).
    vocab_shards: devices the LM head's vocabulary is split over.
    temperature: the rollout's sampling temperature (> 0), which the log-probs are taken at.
    logprob_chunk: positions of full-vocabulary logits at a time.
    loss: the policy loss.
    optimizer: the optax transformation (one per optimizer config: `make_optimizer`).
    grad_accum_dtype: the gradient sums' dtype.
    replicas: data-parallel replicas whose gradient sums stay apart until the apply step, or 0
      (`replica_sums.replicas`).
  """

  model: Model
  mesh: jax.sharding.Mesh
  expert_parallel: ExpertParallel | None
  capacity: bool
  activation_sharding: jax.sharding.NamedSharding | None
  kernel_mesh: jax.sharding.Mesh | None
  vocab_shards: int
  temperature: float
  logprob_chunk: int
  loss: LossConfig
  optimizer: optax.GradientTransformation
  grad_accum_dtype: np.dtype
  replicas: int

  def logprobs(self, params, tokens_bt, routes_btlk=None, valid_bt=None, placement=None):
    """Log-probs `[b, t]` of tokens 1..t+1 (padded rows)."""
    inputs_bt, targets_bt = tokens_bt[:, :-1], tokens_bt[:, 1:]
    stats = self.token_stats
    return stats(params, inputs_bt, targets_bt, routes_btlk, placement, valid_bt=valid_bt)[0]

  def packed_logprobs(self, params, micro: MicroBatch, placement=None):
    """Log-probs `[b, t]` of a packed micro-batch's targets."""
    return self.micro_stats(params, micro, placement)[0]

  def micro_stats(self, params, micro: MicroBatch, placement=None, moe_counts=None):
    """`token_stats` of a micro-batch, padded or packed."""
    return self.token_stats(
      params,
      micro.inputs_bt,
      micro.targets_bt,
      micro.routes_btlk,
      placement,
      micro.positions_bt,
      micro.segment_ids_bt,
      self.valid_positions(micro),
      moe_counts,
    )

  def valid_positions(self, micro: MicroBatch):
    """With an expert capacity: the micro-batch's real input positions (False at padding),
    else None."""
    if not self.capacity:
      return None
    if micro.segment_ids_bt is not None:
      return micro.segment_ids_bt >= 0
    return input_positions(micro.mask_bt)

  def token_stats(
    self,
    params,
    inputs_bt,
    targets_bt,
    routes_btlk=None,
    placement=None,
    positions_bt=None,
    segment_ids_bt=None,
    valid_bt=None,
    moe_counts: dict | None = None,
  ):
    """(log-probs, entropies) `[b, t]` of the targets at the rollout temperature. `valid_bt`:
    MoE, the positions that are tokens (`MoEInputs.valid_bt`); `moe_counts`, a dict, gets the
    MoE layers' routed and dropped assignments."""
    cfg = self.model.config
    moe = MoEInputs(self.expert_parallel, routes_btlk, placement, valid_bt) if cfg.is_moe else None
    hidden_btd, _, *counts = self.model.apply(
      params,
      inputs_bt,
      positions_bt,
      moe=moe,
      return_hidden=True,
      segment_ids_bt=segment_ids_bt,
      return_moe_counts=moe_counts is not None,
      activation_sharding=self.activation_sharding,
      kernel_mesh=self.kernel_mesh,
    )
    if moe_counts is not None:
      moe_counts.update(counts[0])
    return chunked_token_logprobs(
      hidden_btd,
      self.model.lm_head(params),
      targets_bt,
      self.temperature,
      vocab_limit=cfg.vocab_limit,
      chunk=self.logprob_chunk,
      vocab_shards=self.vocab_shards,
      logit_softcap=cfg.final_logit_softcap,
    )

  def micro_loss(self, params, ref_params, micro: MicroBatch, num_tokens, num_seqs, placement):
    """(loss, metrics) of one micro-batch, padded or packed, each normalised by the whole
    mini-batch's counts so that their sums over the micro-batches are the mini-batch's."""
    counts = {} if self.capacity else None
    logp_bt, entropy_bt = self.micro_stats(params, micro, placement, counts)
    ref_logp_bt = None
    if ref_params is not None:
      ref_logp_bt = jax.lax.stop_gradient(self.micro_stats(ref_params, micro, placement)[0])
    loss, metrics = policy_loss(
      logp_bt,
      micro.old_logp_bt,
      micro.advantages,
      micro.mask_bt,
      self.loss,
      num_tokens=num_tokens,
      num_seqs=num_seqs,
      ref_logp_bt=ref_logp_bt,
      behaviour_logp_bt=micro.behaviour_logp_bt,
      segment_ids_bt=micro.segment_ids_bt,
    )
    # Mean entropy of the policy over the trained tokens: a collapse shows here first.
    entropy_sum = jnp.sum(jax.lax.stop_gradient(entropy_bt) * micro.mask_bt)
    metrics = metrics | {"entropy": entropy_sum / jnp.maximum(num_tokens, 1)}
    if counts:  # summed over the micro-batches like the rest; `update` divides them
      metrics |= {f"moe_{k}": v.astype(jnp.float32) for k, v in counts.items()}
    return loss, metrics

  def zero_gradients(self, params):
    """Zeros for the gradient sum: like the parameters, or in `grad_accum_dtype` when that is
    bf16."""
    if self.grad_accum_dtype == jnp.float32:
      return jax.tree.map(jnp.zeros_like, params)
    return jax.tree.map(lambda p: jnp.zeros(p.shape, self.grad_accum_dtype), params)

  def zero_sums(self, metric_keys: tuple[str, ...], dtype, params):
    """Zero (gradients, metric sums of `dtype`) for the packed micro-steps to add into; data
    parallel, one of each per replica."""
    sums = self.zero_gradients(params), {k: jnp.zeros((), dtype) for k in metric_keys}
    return replica_sums.zeros(sums, self.replicas) if self.replicas else sums

  def micro_step(self, params, ref_params, sums, micro, num_tokens, num_seqs, placement=None):
    """`sums` (gradients, metrics) plus one packed micro-batch's; data parallel, each replica
    adds its rows into its own (`replica_sums.per_replica`)."""
    if self.replicas:
      step = replica_sums.per_replica(self._micro_step, self.mesh)
      return step(params, ref_params, sums, micro, num_tokens, num_seqs, placement)
    return self._micro_step(params, ref_params, sums, micro, num_tokens, num_seqs, placement)

  def _micro_step(self, params, ref_params, sums, micro, num_tokens, num_seqs, placement=None):
    grad_sums, metric_sums = sums
    (loss, metrics), grads = jax.value_and_grad(self.micro_loss, has_aux=True)(
      params, ref_params, micro, num_tokens, num_seqs, placement
    )
    metrics = metrics | {"loss": loss}
    return (
      jax.tree.map(_add_gradient, grad_sums, grads),
      {k: metric_sums[k] + metrics[k] for k in metric_sums},
    )

  def apply(self, params, opt_state, sums):
    """The optimizer update of the micro-steps' sums (skipped where not finite)."""
    grads, metrics = replica_sums.total(sums) if self.replicas else sums
    metrics = dict(metrics)
    loss = metrics.pop("loss")
    return apply_if_finite(self.optimizer, params, opt_state, grads, loss, metrics)

  def update(
    self,
    params,
    opt_state,
    ref_params,
    tokens_mbt,
    mask_mbt,
    old_logp_mbt,
    behaviour_logp_mbt,
    advantages_mb,
    routes_mbtlk=None,
    placement_m=None,
  ):
    """One optimizer update over a stack of padded micro-batches."""
    num_tokens = jnp.sum(mask_mbt).astype(jnp.float32)
    num_seqs = jnp.float32(mask_mbt.shape[0] * mask_mbt.shape[1])
    micro_m = (tokens_mbt, mask_mbt, old_logp_mbt, behaviour_logp_mbt, advantages_mb, routes_mbtlk,
               placement_m)  # fmt: skip
    sum_micro_batches = self._sum_micro_batches
    if self.replicas:  # each replica its rows of every micro-batch; one all-reduce at the end
      sum_micro_batches = replica_sums.summed_over_replicas(sum_micro_batches, self.mesh)
    grads, loss, metrics = sum_micro_batches(params, ref_params, micro_m, num_tokens, num_seqs)
    return apply_if_finite(self.optimizer, params, opt_state, grads, loss, metrics)

  def _sum_micro_batches(self, params, ref_params, micro_m, num_tokens, num_seqs):
    """(gradients, loss, metrics) summed over a stack of padded micro-batches, in a scan."""

    def accumulate(grads, xs):
      tokens_bt, mask_bt, old_bt, behaviour_bt, advantages_b, routes, placement = xs
      micro = MicroBatch(
        tokens_bt[:, :-1], tokens_bt[:, 1:], mask_bt, old_bt, behaviour_bt, advantages_b,
        routes_btlk=routes,
      )  # fmt: skip
      (loss, metrics), g = jax.value_and_grad(self.micro_loss, has_aux=True)(
        params, ref_params, micro, num_tokens, num_seqs, placement
      )
      return jax.tree.map(_add_gradient, grads, g), (loss, metrics)

    # Per-micro-batch losses and metrics are whole-batch-normalised, so their sums are the
    # mini-batch values.
    grads, (losses_m, metrics_m) = jax.lax.scan(accumulate, self.zero_gradients(params), micro_m)
    return grads, jnp.sum(losses_m), jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics_m)
