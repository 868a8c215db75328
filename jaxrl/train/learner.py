"""The learner: token log-probs and policy-gradient updates on the training mesh.

One `update` = one RL step's batch, split into `updates_per_step` optimizer updates (PPO
mini-batches), each accumulated over micro-batches. Losses are normalised by the mini-batch's
token/sequence counts, so accumulation gives exactly the loss of the whole mini-batch. A
non-finite loss or gradient skips the update (parameters and optimizer state stay as they were)
and is reported in the metrics.

Two layouts of the micro-batches:
- packed (`pack_length` > 0): the sequences are packed into rows of `pack_length` positions
  (`jaxrl.train.packing`), `micro_batch_size` rows per micro-batch: one shape for the run. The
  host loops over the micro-batches, each a jitted micro-step (forward, backward, gradients
  added into a donated accumulator), then a jitted step applies the sum (`apply_if_finite`).
- padded (`pack_length` 0): rows of `micro_batch_size` sequences padded to the batch's length,
  all micro-batches in one jitted `lax.scan`: one compilation per batch length.

The programs themselves (log-probs, micro-step, apply step, padded update) are
`jaxrl.train.update_programs`; learners of equal settings in a process share them.

Glossary: m micro-batches, b sequences (or packed rows), t target positions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.compile_ahead import Counted, ShapeRecord, shared_function, with_shardings
from jaxrl.kernels.flash_attention import CUDNN_MAX_SEGMENTS
from jaxrl.model import ExpertParallel, Model, Params, copy_params
from jaxrl.model.scan_fit import fit_scan
from jaxrl.sharding import kernel_mesh, tree_shardings
from jaxrl.sharding.expert import ExpertParallelConfig
from jaxrl.train import proximal, replica_sums, update_plan
from jaxrl.train.batch import TrainBatch
from jaxrl.train.losses import LossConfig
from jaxrl.train.optimizer import make_optimizer, optimizer_shardings, training_compiler_options
from jaxrl.train.packing import (
  MicroBatch,
  PackLayout,
  input_positions,
  pack_train_batch,
)
from jaxrl.train.routing import MoEConfig, plan_micro_batches, replayed_routes
from jaxrl.train.update_metrics import average_update_metrics
from jaxrl.train.update_programs import UpdatePrograms
from jaxrl.train.vocab_blocks import head_vocab_shards

log = logging.getLogger(__name__)


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
    pack_length: int = 0,
    abstract: bool = False,
  ):
    """Builds the learner; the LM head's logits exist about `logprob_chunk` positions' worth at
    a time (`chunked_token_logprobs`), so full-vocabulary fp32 logits never exist for a whole
    batch.
    `pack_length` > 0 packs the sequences into micro-batches of `micro_batch_size` rows of that
    many positions (one training shape for the run); 0 pads each micro-batch of
    `micro_batch_size` sequences to the batch's length.

    `abstract`: parameters, optimizer state and reference are shapes on the mesh's shardings
    (`jax.ShapeDtypeStruct`), nothing is allocated or run: a learner for `update_memory` and
    lowering only, also on devices this process does not have (a TPU or GPU topology compiled
    for from a CPU machine, `launch/bench_kernels.py`). `update` and the rest need real ones."""
    if pack_length < 0:
      raise ValueError(
        f"pack_length must be 0 (padded batches) or the positions of a packed row, got "
        f"{pack_length}."
      )
    self.model = model
    self.logprob_chunk = logprob_chunk
    self.pack_length = pack_length
    self.mesh = mesh
    moe = moe or MoEConfig()
    self.moe_cfg = moe
    self.expert_parallel = ExpertParallel.for_mesh(
      model.config,
      mesh,
      ExpertParallelConfig(moe.capacity_factor or None, moe.gmm_impl, moe.exchange),
    )
    # With an expert capacity, padding positions are kept out of it and drops are reported.
    self._capacity = self.expert_parallel is not None and bool(moe.capacity_factor)
    if model.config.is_moe and moe.placement != "static" and not self.spreads_experts:
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
    # A scan over the blocks holds their weights and gradient stacked: off where too large,
    # and on CPU devices that exchange data, where collectives after it can race it.
    self.model = model = fit_scan(model, mesh, self.param_shardings, 2, races_on_cpu=True)
    self.vocab_shards = head_vocab_shards(model.lm_head(self.param_shardings), mesh)
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    self._batch_size_multiple = int(np.prod([mesh.shape[a] for a in batch_axes or ()]))
    self._micro_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, batch_axes)
    )
    self._row_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch_axes))
    # The residual stream between blocks stays split by rows as the batch is (`Model.apply`'s
    # `activation_sharding`): FSDP gathers each layer's weights, never the activations. A
    # data-parallel mesh runs each replica's rows apart (`replica_sums`): nothing to pin.
    self._replicas = replica_sums.replicas(model.config, mesh)
    self.activation_sharding = None
    if not self._replicas:  # the rows' own layout, so that pinning never moves them
      self.activation_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(batch_axes, None, None)
      )
    # Attention kernels on each device's rows and heads (`jaxrl.kernels.partitioning`).
    self.kernel_mesh = kernel_mesh(mesh, rules)
    self.optimizer = make_optimizer(optimizer)
    if abstract:
      if params is not None:
        raise ValueError("An abstract learner builds its parameters' shapes: pass params=None.")
      self.params = with_shardings(model.abstract_params(), self.param_shardings)
    else:
      if params is None:
        init = shared_function(Model.init, model)  # learners of one model share its trace
        params = jax.jit(init, out_shardings=self.param_shardings)(seed)
      self.params = jax.device_put(params, self.param_shardings)
    # The state keeps one layout for the whole run: optimizer moments sharded like their
    # parameters, the rest (step counts) replicated, and the update returns it in that layout.
    # Left to XLA, the first update's outputs were laid out unlike its inputs, so every batch
    # shape compiled twice (and the moments started replicated on every device).
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self._replicated = replicated
    self.opt_shardings = optimizer_shardings(self.optimizer, self.params, self.param_shardings)
    if abstract:
      opt_state = jax.eval_shape(self.optimizer.init, self.params)
      self.opt_state = with_shardings(opt_state, self.opt_shardings)
    else:
      init = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)
      self.opt_state = init(self.params)
    # No reference copy unless the KL term needs one. It starts as the parameters the learner
    # was built with; a run moves it to the weights RL starts from (`reset_reference` after a
    # warm-up, the checkpoint's reference on a resume).
    self._ref_params = None
    if loss.kl_weight > 0:
      self._ref_params = self.params if abstract else jax.tree.map(jnp.copy, self.params)
    self._shapes = ShapeRecord()  # this learner's compiled shapes (`compiled_shapes`)
    self._programs = UpdatePrograms(
      model, mesh, self.expert_parallel, self._capacity, self.activation_sharding,
      self.kernel_mesh, self.vocab_shards, self.temperature, logprob_chunk, loss, self.optimizer,
      jnp.dtype(optimizer.grad_accum_dtype), self._replicas,
    )  # fmt: skip
    self._jit_programs()
    self._warned_lengths: set[int] = set()
    self._lent = None  # (store, version) the live parameters were lent to (`publish_to`)
    self._compiling = None  # the future of the programs `compile_ahead` is compiling
    self._stop_compiling = threading.Event()  # `stop_compiling_ahead`

  def _jit_programs(self) -> None:
    """Jits the update's programs (`UpdatePrograms`) for this learner's shardings. Learners of
    equal settings in a process share their traces and compiled programs (`shared_function`);
    each counts the shapes it runs (`compiled_shapes`)."""
    programs, mesh, replicated = self._programs, self.mesh, self._replicated
    state_out = (self.param_shardings, self.opt_shardings, replicated)
    options = training_compiler_options(mesh)

    def counted(name, method, fixed, **jit_settings):
      """`fixed`: the leading arguments of this learner's fixed shapes (weights, optimizer
      state, reference weights, gradient sums), which the count leaves out."""
      jitted = jax.jit(shared_function(method, programs), **jit_settings)
      return Counted(jitted, self._shapes, name, fixed)

    self._update = counted(
      "update", UpdatePrograms.update, 3, donate_argnums=(0, 1), out_shardings=state_out,
      compiler_options=options,
    )  # fmt: skip
    # Packed: the micro-step adds into the (gradient, metric) sums it is handed (donated); the
    # apply step turns the sums into an update. Data parallel: each replica into its own.
    self._sum_shardings = (self.param_shardings, replicated)
    if self._replicas:
      self._sum_shardings = replica_sums.sharding(mesh)
    self._micro_step = counted(
      "micro_step", UpdatePrograms.micro_step, 3, donate_argnums=(2,),
      out_shardings=self._sum_shardings, compiler_options=options,
    )  # fmt: skip
    # Not the sums: no output has their place (XLA reuses a donated buffer only for an output,
    # so donating them only warned, "Some donated buffers were not usable", at each first
    # update); they are freed when the update returns.
    self._apply = counted(
      "apply", UpdatePrograms.apply, 3, donate_argnums=(0, 1), out_shardings=state_out,
      compiler_options=options,
    )  # fmt: skip
    # Log-probs the host reads (the proximal policy's, the train/inference mismatch's) come out
    # whole on every device: in a learner of several processes a host reads only its own.
    self._logprobs = counted("logprobs", UpdatePrograms.logprobs, 1, out_shardings=replicated)
    self._packed_logprobs = counted(
      "packed_logprobs", UpdatePrograms.packed_logprobs, 1, out_shardings=replicated
    )
    self.__dict__.pop("_zero_sums", None)  # built again for these programs when next needed

  @property
  def activation_sharding(self) -> jax.sharding.NamedSharding | None:
    """The residual stream's layout between blocks (None: XLA's choice). Set, the programs
    are jitted again with it."""
    return self._activation_sharding

  @activation_sharding.setter
  def activation_sharding(self, sharding: jax.sharding.NamedSharding | None) -> None:
    self._activation_sharding = sharding
    if hasattr(self, "_programs"):
      self._programs = dataclasses.replace(self._programs, activation_sharding=sharding)
      self._jit_programs()

  def compiled_shapes(self, program: str | None = None) -> int:
    """Argument shapes this learner ran or compiled ahead `program` on ("update",
    "micro_step", "apply", "logprobs", "packed_logprobs"; None: all of them): its programs,
    compiled by it or by a learner of the same settings in the process before."""
    return self._shapes.count(program)

  def publish_to(
    self, store, version: int, *, lend: bool = False, dtypes=None, on_device: bool = False
  ) -> None:
    """Publishes the weights to `store` as `version` (its ownership rule, `rl/weights.py`):
    with `lend` the live buffers, for a reader that takes them before the next update or
    warm-up step, which recalls them first (`recall_lent`); else a copy the store owns, made
    on the training devices in `dtypes` (the readers' parameter dtypes; None: these), and
    kept there with `on_device` (readers in this process move it device to device), else
    brought to the host."""
    self.recall_lent()
    params = self.params
    if not lend and (on_device or dtypes is not None):
      params = copy_params(params, dtypes)
    store.publish(params if lend or on_device else jax.device_get(params), version)
    self._lent = (store, version) if lend else None

  def recall_lent(self) -> None:
    """Takes back buffers lent to a store; whoever donates the parameters calls it first."""
    lent, self._lent = self._lent, None
    if lent is not None:
      lent[0].recall(lent[1])

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
    self,
    params: Params,
    tokens_bt: np.ndarray,
    routes_btlk: np.ndarray | None = None,
    mask_bt: np.ndarray | None = None,
  ) -> jax.Array:
    """Log-probs [b, t] of tokens 1..t+1 under `params` at the rollout temperature (MoE: with
    these routes replayed, when given). `mask_bt`, the targets trained on: with an expert
    capacity, the positions after a row's last target are padding that takes none (as in
    `update`); None: every position is a token."""
    valid_bt = None if mask_bt is None or not self._capacity else input_positions(mask_bt)
    return self._logprobs(params, jnp.asarray(tokens_bt), routes_btlk, valid_bt)

  def _replayed_routes(self, batch: TrainBatch) -> np.ndarray | None:
    if not (self.model.config.is_moe and self.moe_cfg.routing_replay):
      return None
    return replayed_routes(batch.routes_btlk, batch.mask_bt.shape, self.model.config.num_experts)

  def update(self, batch: TrainBatch) -> dict[str, jax.Array]:
    """Runs `updates_per_step` optimizer updates over the batch; returns averaged metrics.

    Metrics stay on device (no host sync here); `skipped` counts updates dropped because the
    loss or gradient was not finite.
    """
    self.check_batch_size(batch.size)
    if self._compiling is not None:  # `compile_ahead`'s programs, which the update is to run
      compiling, self._compiling = self._compiling, None
      compiling.result()
    self.recall_lent()  # the update donates the parameters
    proximal_bt = batch.old_logp_bt
    if self.loss_cfg.proximal == "recompute":  # decoupled PPO: the policy before this step
      proximal_bt = self.proximal_logprobs(batch)
    routes_btlk = self._replayed_routes(batch)
    run = self._packed_update if self.pack_length else self._padded_update
    all_metrics, placement_metrics = [], []
    scored = dataclasses.replace(batch, old_logp_bt=proximal_bt, routes_btlk=routes_btlk)
    parts = zip(
      scored.split(self.updates_per_step), batch.split(self.updates_per_step), strict=True
    )
    for part, sampled in parts:  # `sampled`: the same rows with the behaviour log-probs
      metrics, planned = run(part, sampled.old_logp_bt)
      all_metrics.append(metrics)
      if planned is not None:
        placement_metrics.append(planned)
    out = average_update_metrics(all_metrics)
    if placement_metrics:
      out |= {k: float(np.mean([m[k] for m in placement_metrics])) for k in placement_metrics[0]}
    return out

  @property
  def ref_params(self) -> Params | None:
    """The KL term's reference policy; None when `loss.kl_weight` is 0."""
    return self._ref_params

  @ref_params.setter
  def ref_params(self, params: Params) -> None:
    """A new reference (host or device arrays, e.g. a checkpoint's), copied onto the
    parameters' shardings: the updates donate `params`, never the reference."""
    if self._ref_params is None:
      raise ValueError("This learner has no KL reference: its loss.kl_weight is 0.")
    self._ref_params = jax.tree.map(
      lambda x, sharding: jax.device_put(x, sharding, may_alias=False), params, self.param_shardings
    )

  def reset_reference(self) -> None:
    """Makes the current parameters the KL reference (the weights RL starts from, after a
    supervised warm-up); nothing to do without a KL term."""
    if self._ref_params is not None:
      self.ref_params = self.params

  @property
  def spreads_experts(self) -> bool:
    """Whether the MoE layers spread their experts over devices (an expert axis > 1): only
    then do placements apply (not on the grouped dispatch's one device)."""
    return self.expert_parallel is not None and self.expert_parallel.spreads_experts

  def _plan(self, routes_mbtlk: np.ndarray | None):
    """Expert placements per micro-batch (expert-parallel routing replay), or (None, None)."""
    # No micro-batch (packed, a mini-batch without a trained target): no placement to plan, and
    # none to stack (a TypeError); its update then reports no placement metrics.
    if routes_mbtlk is None or not self.spreads_experts or len(routes_mbtlk) == 0:
      return None, None
    return plan_micro_batches(
      routes_mbtlk, self.model.config.num_experts, self.mesh.shape["expert"], self.moe_cfg
    )

  def _padded_update(self, part: TrainBatch, behaviour_bt: np.ndarray):
    """One optimizer update over padded micro-batches (`part.old_logp_bt`: the ratio's
    denominators); returns (metrics, placement metrics or None)."""
    arrays = [part.tokens_bt, part.mask_bt, part.old_logp_bt, behaviour_bt, part.advantages_b]
    if part.routes_btlk is not None:
      arrays.append(part.routes_btlk)
    stacked = [x.reshape(-1, self.micro_batch_size, *x.shape[1:]) for x in arrays]
    micro = [jax.device_put(x, self._micro_sharding) for x in stacked]
    routes_m = micro[5] if part.routes_btlk is not None else None
    placement_m, planned = self._plan(stacked[5] if part.routes_btlk is not None else None)
    self.params, self.opt_state, metrics = self._update(
      self.params, self.opt_state, self.ref_params, *micro[:5], routes_m, placement_m
    )
    return metrics, planned

  def _pack(self, batch: TrainBatch, behaviour_bt: np.ndarray) -> tuple[PackLayout, MicroBatch]:
    """The batch packed into micro-batches of `micro_batch_size` rows (routes filled)."""
    # cuDNN's packed attention holds a fixed number of sequences a row; a row with more would
    # run the Pallas kernel instead (`jaxrl.kernels.flash_attention.cudnn`).
    cudnn = self.model.config.attention == "cudnn"
    return pack_train_batch(
      batch,
      behaviour_bt,
      pack_length=self.pack_length,
      micro_batch_size=self.micro_batch_size,
      max_segments=CUDNN_MAX_SEGMENTS if cudnn else None,
      num_experts=self.model.config.num_experts,
      warned_lengths=self._warned_lengths,
    )

  def _packed_update(self, part: TrainBatch, behaviour_bt: np.ndarray):
    """One optimizer update over packed micro-batches: a jitted micro-step per micro-batch,
    then the jitted apply step; returns (metrics, placement metrics or None)."""
    layout, packed = self._pack(part, behaviour_bt)
    placement_m, planned = self._plan(packed.routes_btlk)
    # Whole mini-batch counts (host numbers), as the padded path normalises by.
    num_tokens = np.float32(np.sum(part.mask_bt))
    num_seqs = np.float32(part.size)
    acc = self._zero_sums(self.params)
    for i, micro in enumerate(self._put_micro_batches(packed)):
      placement = proximal.micro_placement(placement_m, i)
      acc = self._micro_step(
        self.params, self.ref_params, acc, micro, num_tokens, num_seqs, placement
      )
    self.params, self.opt_state, metrics = self._apply(self.params, self.opt_state, acc)
    return metrics, planned

  def _put_micro_batches(self, packed: MicroBatch) -> list[MicroBatch]:
    """Each packed micro-batch `[b, t]` on the training mesh, rows split over data and fsdp;
    one transfer for all of them."""
    count = packed.inputs_bt.shape[0]
    micro = [jax.tree.map(lambda x, i=i: x[i], packed) for i in range(count)]
    return jax.device_put(micro, self._row_sharding)

  @functools.cached_property
  def _zero_sums(self):
    """Jitted: zero (gradients, metric sums) for the micro-steps to add into."""
    micro = update_plan.abstract_micro(self, self.pack_length)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    loss, metrics = jax.eval_shape(
      self._programs.micro_loss, self.params, self.ref_params, micro, scalar, scalar, None
    )
    keys = tuple(sorted({*metrics, "loss"}))
    zeros = shared_function(UpdatePrograms.zero_sums, self._programs, keys, loss.dtype)
    return jax.jit(zeros, out_shardings=self._sum_shardings)

  def update_memory(self, batch_size: int, length: int) -> dict[str, float]:
    """XLA's buffer plan of one optimizer update, compiled but not run (`update_plan`)."""
    return update_plan.update_memory(self, batch_size, length)

  def precompile(self, batch_size: int, lengths: Sequence[int]) -> int:
    """Compiles `update` (and the proximal log-probs it may need) for batches of `batch_size`
    sequences of each of these token lengths by running it on batches that change nothing,
    so that no step stalls on a compilation. Returns the number of training shapes compiled:
    packed, one (plus one per longer row length that a length past `pack_length` needs),
    padded, one per length (`update_plan.precompile`)."""
    return update_plan.precompile(self, batch_size, lengths)

  def compile_ahead(self, batch_size: int, lengths: Sequence[int] = ()) -> None:
    """Starts compiling the update's programs for these sequence lengths (packed: the rows of
    `pack_length` positions too) on background threads, without running anything, so that
    they compile while the run does other work (its first rollout); the next `update` waits
    for them and raises what failed (`update_plan.compile_ahead`)."""
    self._compiling = update_plan.compile_ahead(self, batch_size, lengths, self._stop_compiling)

  def stop_compiling_ahead(self) -> None:
    """For a learner its owner is done with (any thread): `compile_ahead`'s programs not begun
    are skipped, its threads end after those under way."""
    self._stop_compiling.set()

  def proximal_logprobs(self, batch: TrainBatch) -> np.ndarray:
    """The current weights' log-probs of the batch's targets (0 off the mask), as the update
    computes them (`proximal.proximal_logprobs`): the proximal policy of decoupled PPO."""
    return proximal.proximal_logprobs(self, batch)
