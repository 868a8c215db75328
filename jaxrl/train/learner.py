"""The learner: token log-probs and policy-gradient updates on the training mesh.

One `update` = one RL step's batch, split into `updates_per_step` optimizer updates (PPO
mini-batches), each accumulated over micro-batches inside one jitted `lax.scan`. Losses are
normalised by the mini-batch's token/sequence counts, so accumulation gives exactly the loss of
the whole mini-batch. A non-finite loss or gradient skips the update (parameters and optimizer
state stay as they were) and is reported in the metrics.

Glossary: m micro-batches, b sequences, t target positions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.model import ExpertParallel, Model, MoEInputs, Params
from jaxrl.sharding import tree_shardings
from jaxrl.sharding.expert import ExpertParallelConfig
from jaxrl.train.losses import LossConfig, chunked_token_logprobs, policy_loss
from jaxrl.train.optimizer import make_optimizer
from jaxrl.train.routing import MoEConfig, fill_padding, plan_micro_batches


@dataclasses.dataclass
class TrainBatch:
  """Host arrays of one RL batch; position t of every `_bt` array scores token t + 1.

  Attributes:
    tokens_bt: [b, t + 1] prompt + response ids, right-padded.
    mask_bt: [b, t] 1 where the target (token t + 1) is a response token.
    old_logp_bt: [b, t] behaviour log-probs of the targets (the rollout's), 0 off the mask.
    advantages_b: [b] one advantage per sequence.
    routes_btlk: MoE: int32 [b, t, layers, k] the experts rollout routed each input token to
      (for routing replay; -1 at padding positions), or None.
  """

  tokens_bt: np.ndarray
  mask_bt: np.ndarray
  old_logp_bt: np.ndarray
  advantages_b: np.ndarray
  routes_btlk: np.ndarray | None = None

  @property
  def size(self) -> int:
    return self.tokens_bt.shape[0]


class Learner:
  """Owns the trained parameters, the optimizer state and the jitted update."""

  def __init__(
    self,
    model: Model,
    mesh: jax.sharding.Mesh,
    rules,
    *,
    loss: LossConfig,
    optimizer,
    updates_per_step: int,
    micro_batch_size: int,
    temperature: float,
    params: Params | None = None,
    seed: int = 0,
    moe: MoEConfig | None = None,
    logprob_chunk: int = 128,
  ):
    """Builds the learner; `logprob_chunk` positions of the LM head are applied at a time
    (`chunked_token_logprobs`), so full-vocabulary fp32 logits never exist for a whole batch."""
    self.model = model
    self.logprob_chunk = logprob_chunk
    self.mesh = mesh
    moe = moe or MoEConfig()
    self.moe_cfg = moe
    self.expert_parallel = ExpertParallel.for_mesh(
      model.config,
      mesh,
      ExpertParallelConfig(moe.capacity_factor or None, moe.gmm_impl, moe.exchange),
    )
    if model.config.is_moe and moe.placement != "static" and self.expert_parallel is None:
      raise ValueError(
        f"train.moe.placement={moe.placement!r} places experts on the training mesh's expert "
        "axis, which this mesh does not have (size 1): give it one, or use placement='static'."
      )
    self.loss_cfg = loss
    self.updates_per_step = updates_per_step
    self.micro_batch_size = micro_batch_size
    self.temperature = temperature if temperature > 0 else 1.0
    shapes = jax.tree.map(lambda x: x.shape, model.abstract_params())
    self.param_shardings = tree_shardings(model.logical_axes, mesh, rules, shapes)
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    self._batch_size_multiple = int(np.prod([mesh.shape[a] for a in batch_axes or ()]))
    self._micro_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, batch_axes)
    )
    self.optimizer = make_optimizer(optimizer)
    if params is None:
      params = jax.jit(model.init, out_shardings=self.param_shardings)(seed)
    self.params = jax.device_put(params, self.param_shardings)
    # The state keeps one layout for the whole run: optimizer moments sharded like their
    # parameters, the rest (step counts) replicated, and the update returns it in that layout.
    # Left to XLA, the first update's outputs were laid out unlike its inputs, so every batch
    # shape compiled twice (and the moments started replicated on every device).
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.opt_shardings = optimizer_shardings(self.optimizer, self.params, self.param_shardings)
    self.opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(self.params)
    # No reference copy unless the KL term needs one.
    self.ref_params = jax.tree.map(jnp.copy, self.params) if loss.kl_weight > 0 else None
    self._update = jax.jit(
      self._update_impl,
      donate_argnums=(0, 1),
      out_shardings=(self.param_shardings, self.opt_shardings, replicated),
      compiler_options=training_compiler_options(mesh),
    )
    self._logprobs = jax.jit(self._logprobs_impl)

  def publish_to(self, store, version: int) -> None:
    """Hands `store` (a `WeightStore`, or anything with its `publish`) a host copy of the
    weights as `version`: the update donates the device buffers, so readers need their own."""
    store.publish(jax.device_get(self.params), version)

  def wait_published(self) -> None:
    """Returns at once: `publish_to` has finished when it returns. (A learner in another
    process, `RayLearner`, publishes in the background; this waits for it there.)"""

  def check_batch_size(self, batch_size: int) -> None:
    """Raises unless a batch of this many sequences splits into updates and micro-batches."""
    per_update, rem = divmod(batch_size, self.updates_per_step)
    if rem or per_update % self.micro_batch_size:
      raise ValueError(
        f"A batch of {batch_size} sequences must split into train.updates_per_step="
        f"{self.updates_per_step} updates of whole micro-batches of train.micro_batch_size="
        f"{self.micro_batch_size}; change prompts_per_step, group_size or these settings."
      )
    if self.micro_batch_size % self._batch_size_multiple:
      raise ValueError(
        f"train.micro_batch_size={self.micro_batch_size} must be a multiple of the training "
        f"mesh's data*fsdp size {self._batch_size_multiple}."
      )

  def logprobs(
    self, params: Params, tokens_bt: np.ndarray, routes_btlk: np.ndarray | None = None
  ) -> jax.Array:
    """Log-probs [b, t] of tokens 1..t+1 under `params` at the rollout temperature (MoE: with
    these routes replayed, when given)."""
    return self._logprobs(params, jnp.asarray(tokens_bt), routes_btlk)

  def _logprobs_impl(self, params, tokens_bt, routes_btlk=None, placement=None):
    return self._token_stats(params, tokens_bt, routes_btlk, placement)[0]

  def _token_stats(self, params, tokens_bt, routes_btlk=None, placement=None):
    """(log-probs, entropies) `[b, t]` of tokens 1..t+1 at the rollout temperature."""
    cfg = self.model.config
    moe = MoEInputs(self.expert_parallel, routes_btlk, placement) if cfg.is_moe else None
    hidden_btd, _ = self.model.apply(params, tokens_bt[:, :-1], moe=moe, return_hidden=True)
    return chunked_token_logprobs(
      hidden_btd,
      self.model.lm_head(params),
      tokens_bt[:, 1:],
      self.temperature,
      vocab_limit=cfg.vocab_limit,
      chunk=self.logprob_chunk,
    )

  def _replayed_routes(self, batch: TrainBatch) -> np.ndarray | None:
    if not (self.model.config.is_moe and self.moe_cfg.routing_replay):
      return None
    if batch.routes_btlk is None:
      raise ValueError(
        "train.moe.routing_replay needs the rollout's routing trace with the batch; the paged "
        "engine records it (rollout.engine='paged'), the static engine does not."
      )
    if batch.routes_btlk.shape[:2] != batch.mask_bt.shape:
      raise ValueError(
        f"routes_btlk has shape {batch.routes_btlk.shape}; it must be [b, t, layers, k] with "
        f"[b, t] = {batch.mask_bt.shape}, like the batch's targets."
      )
    return fill_padding(batch.routes_btlk, self.model.config.num_experts)

  def update(self, batch: TrainBatch) -> dict[str, jax.Array]:
    """Runs `updates_per_step` optimizer updates over the batch; returns averaged metrics.

    Metrics stay on device (no host sync here); `skipped` counts updates dropped because the
    loss or gradient was not finite.
    """
    self.check_batch_size(batch.size)
    per_update = batch.size // self.updates_per_step
    behaviour_bt = batch.old_logp_bt
    proximal_bt = behaviour_bt
    if self.loss_cfg.proximal == "recompute":  # decoupled PPO: the policy before this step
      proximal_bt = self.proximal_logprobs(batch)
    routes_btlk = self._replayed_routes(batch)
    all_metrics, placement_metrics = [], []
    for u in range(self.updates_per_step):
      rows = slice(u * per_update, (u + 1) * per_update)
      arrays = [
        batch.tokens_bt[rows],
        batch.mask_bt[rows],
        proximal_bt[rows],
        behaviour_bt[rows],
        batch.advantages_b[rows],
      ]
      if routes_btlk is not None:
        arrays.append(routes_btlk[rows])
      micro = [
        jax.device_put(x.reshape(-1, self.micro_batch_size, *x.shape[1:]), self._micro_sharding)
        for x in arrays
      ]
      routes_m = micro[5] if routes_btlk is not None else None
      placement_m = None
      if routes_btlk is not None and self.expert_parallel is not None:
        placement_m, planned = plan_micro_batches(
          arrays[5].reshape(-1, self.micro_batch_size, *arrays[5].shape[1:]),
          self.model.config.num_experts,
          self.mesh.shape["expert"],
          self.moe_cfg,
        )
        placement_metrics.append(planned)
      self.params, self.opt_state, metrics = self._update(
        self.params, self.opt_state, self.ref_params, *micro[:5], routes_m, placement_m
      )
      all_metrics.append(metrics)
    out = jax.tree.map(lambda *xs: sum(xs) / len(xs), *all_metrics)
    if placement_metrics:
      out |= {k: float(np.mean([m[k] for m in placement_metrics])) for k in placement_metrics[0]}
    # Effective sample size of the behaviour weights, as a fraction of the tokens.
    ess = out["behaviour_weight_mean"] ** 2 / jnp.maximum(out["behaviour_weight_sq_mean"], 1e-30)
    return out | {"skipped": sum(m["skipped"] for m in all_metrics), "behaviour_ess": ess}

  def update_memory(self, batch_size: int, length: int) -> dict[str, float]:
    """XLA's buffer plan for one optimizer update over `batch_size` sequences of `length`
    tokens (dense models, no routing replay), compiled but not run: GiB of its arguments
    (parameters, optimizer state, batch), outputs, and temporaries (gradients, activations,
    logits chunks). A lower bound on what the update needs beside the process's other memory."""
    m = batch_size // self.micro_batch_size
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=self._micro_sharding)  # noqa: E731
    per_token = (m, self.micro_batch_size, length - 1)
    tokens = jax.ShapeDtypeStruct((m, self.micro_batch_size, length), jnp.int32,
                                  sharding=self._micro_sharding)  # fmt: skip
    compiled = self._update.lower(
      self.params, self.opt_state, self.ref_params, tokens, shape(*per_token), shape(*per_token),
      shape(*per_token), shape(m, self.micro_batch_size), None, None,
    ).compile()  # fmt: skip
    analysis = compiled.memory_analysis()
    gib = 2.0**30
    return {
      "arguments_gib": analysis.argument_size_in_bytes / gib,
      "outputs_gib": analysis.output_size_in_bytes / gib,
      "temporaries_gib": analysis.temp_size_in_bytes / gib,
    }

  def precompile(self, batch_size: int, lengths: Sequence[int]) -> int:
    """Compiles `update` (and the proximal log-probs it may need) for batches of `batch_size`
    sequences of each of these token lengths, by running it on copies of the state with an
    all-padding batch (nothing trained). Returns the number of lengths."""
    params, opt_state = self.params, self.opt_state
    cfg = self.model.config
    for length in lengths:
      routes = None
      if cfg.is_moe and self.moe_cfg.routing_replay:
        routes = np.full((batch_size, length - 1, cfg.num_layers, cfg.experts_per_token), -1)
      blank = TrainBatch(
        tokens_bt=np.zeros((batch_size, length), np.int32),
        mask_bt=np.zeros((batch_size, length - 1), np.float32),
        old_logp_bt=np.zeros((batch_size, length - 1), np.float32),
        advantages_b=np.zeros((batch_size,), np.float32),
        routes_btlk=routes,
      )
      # `update` donates the state it is given: hand it copies.
      self.params, self.opt_state = jax.tree.map(jnp.copy, (params, opt_state))
      jax.block_until_ready(self.update(blank))
    self.params, self.opt_state = params, opt_state
    return len(lengths)

  def proximal_logprobs(self, batch: TrainBatch) -> np.ndarray:
    """The current weights' log-probs of the batch's targets (0 off the mask), computed one
    micro-batch at a time: the proximal policy of decoupled PPO."""
    routes_btlk = self._replayed_routes(batch)
    chunks = [
      np.asarray(
        self.logprobs(
          self.params,
          batch.tokens_bt[i : i + self.micro_batch_size],
          None if routes_btlk is None else routes_btlk[i : i + self.micro_batch_size],
        )
      )
      for i in range(0, batch.size, self.micro_batch_size)
    ]
    return np.concatenate(chunks) * (batch.mask_bt > 0)

  def _update_impl(
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
    num_tokens = jnp.sum(mask_mbt).astype(jnp.float32)
    num_seqs = jnp.float32(mask_mbt.shape[0] * mask_mbt.shape[1])

    def micro_loss(
      p, tokens_bt, mask_bt, old_logp_bt, behaviour_logp_bt, advantages_b, routes, placement
    ):
      logp_bt, entropy_bt = self._token_stats(p, tokens_bt, routes, placement)
      ref_logp_bt = (
        None
        if ref_params is None
        else jax.lax.stop_gradient(self._logprobs_impl(ref_params, tokens_bt, routes, placement))
      )
      loss, metrics = policy_loss(
        logp_bt,
        old_logp_bt,
        advantages_b,
        mask_bt,
        self.loss_cfg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        ref_logp_bt=ref_logp_bt,
        behaviour_logp_bt=behaviour_logp_bt,
      )
      # Mean entropy of the policy over the trained tokens: a collapse shows here first.
      entropy = jnp.sum(jax.lax.stop_gradient(entropy_bt) * mask_bt) / jnp.maximum(num_tokens, 1)
      return loss, metrics | {"entropy": entropy}

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(grads, micro):
      (loss, metrics), g = grad_fn(params, *micro)
      return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    # Per-micro-batch losses and metrics are whole-batch-normalised, so their sums are the
    # mini-batch values.
    grads, (losses_m, metrics_m) = jax.lax.scan(
      accumulate,
      jax.tree.map(jnp.zeros_like, params),
      (tokens_mbt, mask_mbt, old_logp_mbt, behaviour_logp_mbt, advantages_mb, routes_mbtlk,
       placement_m),
    )  # fmt: skip
    loss = jnp.sum(losses_m)
    metrics = jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics_m)
    return apply_if_finite(self.optimizer, params, opt_state, grads, loss, metrics)


_CPU_MEMORY_FIRST = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def training_compiler_options(mesh: jax.sharding.Mesh) -> dict[str, str] | None:
  """XLA options for a training step compiled for `mesh`'s devices.

  On CPU, XLA's default scheduler orders operations for concurrency, not memory: it runs every
  layer's rematerialisation ahead of the backward pass (XLA:CPU drops the optimization barrier
  that `jax.checkpoint` relies on) and every Adam leaf's intermediate ahead of the updates, so
  they are all live at once. Its memory-first scheduler planned a Qwen3-0.6B update (16 x 391
  tokens, micro-batches of 1) in 4.3 GiB of temporaries instead of 6.2 (`Learner.update_memory`).
  Accelerator backends schedule for memory already: None there, and None where this XLA does
  not know the option.
  """
  if mesh.devices.flat[0].platform != "cpu" or not _cpu_knows_memory_first():
    return None
  return dict(_CPU_MEMORY_FIRST)


@functools.cache
def _cpu_knows_memory_first() -> bool:
  try:
    jax.jit(lambda x: x + 1, compiler_options=_CPU_MEMORY_FIRST).lower(0).compile()
  except Exception:  # noqa: BLE001  (XLA raises its own error types for an unknown option)
    return False
  return True


def optimizer_shardings(optimizer: optax.GradientTransformation, params, param_shardings):
  """Shardings for `optimizer`'s state over `params`: each parameter-shaped part (Adam's
  moments) like its parameter, the rest (step counts) replicated on the parameters' mesh."""
  mesh = jax.tree.leaves(param_shardings)[0].mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    jax.eval_shape(optimizer.init, params),
    param_shardings,
    transform_non_params=lambda _: replicated,
  )


def apply_if_finite(
  optimizer: optax.GradientTransformation, params, opt_state, grads, loss, metrics: dict
):
  """Applies the update unless loss or gradient is NaN/inf; returns (params, opt_state, metrics).

  A `lax.cond`, not a `where` over the new and old state: with the state donated, XLA keeps the
  old optimizer state alive beside the new one for a `where` (a copy of every Adam moment, 4.4
  GiB at 0.6B parameters, live through the whole update); the branches update it in place.
  """
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def step(params, opt_state, grads):
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state

  def keep(params, opt_state, grads):
    del grads
    return params, opt_state

  new_params, new_opt_state = jax.lax.cond(finite, step, keep, params, opt_state, grads)
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.int32))
  return new_params, new_opt_state, metrics
