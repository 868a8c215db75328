"""Roofline cost model of the two stages: rollout instances and training meshes.

Rollout: a decode step reads the weights and every running sequence's KV once, and does
2·N_active FLOPs per sequence, so its time is the larger of bytes over memory bandwidth and
FLOPs over compute (each scaled by a fitted efficiency), plus tensor-parallel all-reduces and a
fixed per-step overhead. Prefill is compute-bound. Long-tail lengths enter three ways: the mean
length sets the work per sample, the token-weighted mean position sets the KV a running
sequence holds, and the longest responses of a step set the tail latency (the expected longest
on the instance that hosts the top share, the longest of the rest on every other instance).

Training: (6 + 2·extra forward passes)·N_active·tokens over devices·FLOP/s·MFU, overlapped with
the FSDP all-gathers and reduce-scatters; tensor and expert exchanges are added. Memory per
device is a hard limit for both stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxrl.model.config import ModelConfig
from jaxrl.scheduler.catalog import Accelerator

# Share of device memory a plan may fill (the rest: runtime, fragmentation, compiler scratch).
USABLE_MEMORY = 0.9
# Latency of one collective call, seconds.
COLLECTIVE_LATENCY_S = 10e-6
# Training state bytes per parameter: fp32 master + Adam m and v + bf16 weights + bf16 grads.
TRAIN_STATE_BYTES_PER_PARAM = 16
# A data-parallel training mesh keeps the whole state on each replica, also while a colocated
# rollout engine runs beside it (only activations are freed then): it is offered only where
# that state takes at most this share of the usable memory, so the rest holds the engine.
DATA_PARALLEL_STATE_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one RL step asks of the stages.

  Attributes:
    prompts_per_step: prompts per training step.
    group_size: responses per prompt.
    prompt_len: tokens per prompt.
    response_median: median response length (lognormal).
    response_sigma: lognormal sigma of response lengths (0: all equal to the median).
    response_cap: maximum response length (max_new_tokens).
    max_staleness: versions a trained sample may lag the learner (0: synchronous).
    updates_per_step: optimizer updates per step (PPO mini-batches).
    extra_forward_passes: forward passes besides the one inside backprop (reference model,
      proximal / old log-probs).
    micro_batch_size: if > 0, sequences per training micro-batch, which the training mesh's
      batch axes (fsdp x expert) must divide.
  """

  prompts_per_step: int = 64
  group_size: int = 8
  prompt_len: int = 256
  response_median: float = 1024
  response_sigma: float = 1.0
  response_cap: int = 8192
  max_staleness: int = 1
  updates_per_step: int = 1
  extra_forward_passes: int = 2
  micro_batch_size: int = 0

  def __post_init__(self):
    for name in ("prompts_per_step", "group_size", "prompt_len", "response_cap"):
      if getattr(self, name) < 1:
        raise ValueError(f"workload.{name} must be >= 1, got {getattr(self, name)}.")
    if not 1 <= self.response_median <= self.response_cap:
      raise ValueError("workload.response_median must be in [1, response_cap].")
    if self.response_sigma < 0 or self.max_staleness < 0 or self.extra_forward_passes < 0:
      raise ValueError("workload: response_sigma, max_staleness, extra_forward_passes >= 0.")
    if self.updates_per_step < 1:
      raise ValueError("workload.updates_per_step must be >= 1.")

  @property
  def samples_per_step(self) -> int:
    return self.prompts_per_step * self.group_size

  def lengths(self) -> LengthStats:
    return _length_stats(
      self.response_median, self.response_sigma, self.response_cap, self.samples_per_step
    )


@dataclasses.dataclass(frozen=True)
class LengthStats:
  mean: float  # E[L]
  mean_position: float  # E[L^2] / (2 E[L]): where a running sequence is, on average
  expected_max: float  # E[max of one step's L]
  tail_count: int  # a step's longest responses a tail host must hold: top 1% or all at the cap
  bulk_max: float  # the longest response left to the other instances (quantile past tail_count)
  quantiles: tuple[float, ...]  # 1024 equal-mass quantiles, for samplers


@functools.lru_cache(maxsize=64)
def _length_stats(median: float, sigma: float, cap: int, n: int) -> LengthStats:
  from scipy.stats import norm

  u = (np.arange(4096) + 0.5) / 4096
  q = np.clip(median * np.exp(sigma * norm.ppf(u)), 1, cap)
  # E[max of n] = E[Q(U^(1/n))] for U uniform.
  top = np.clip(median * np.exp(sigma * norm.ppf(u ** (1.0 / n))), 1, cap)
  at_cap = norm.sf(math.log(cap / median) / sigma) if sigma > 0 else float(median >= cap)
  tail_count = max(math.ceil(n / 100), math.ceil(n * at_cap))
  bulk = median * math.exp(sigma * norm.ppf(1 - min(tail_count, n - 0.5) / n)) if sigma else median
  return LengthStats(
    mean=float(q.mean()),
    mean_position=float((q**2).mean() / (2 * q.mean())),
    expected_max=float(top.mean()),
    tail_count=int(tail_count),
    bulk_max=float(np.clip(bulk, 1, cap)),
    quantiles=tuple(float(x) for x in q[2::4]),
  )


def _itemsize(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2}[dtype]


def active_params(model: ModelConfig) -> int:
  """Parameters one token uses (MoE: only its top-k experts)."""
  idle = 0
  if model.is_moe:
    idle = model.num_layers * (model.num_experts - model.experts_per_token) * 3 * model.d_model
    idle *= model.moe_mlp_dim
  return model.num_params() - idle


def weight_bytes(model: ModelConfig) -> float:
  return model.num_params() * _itemsize(model.param_dtype)


def kv_bytes_per_token(model: ModelConfig) -> float:
  """Keys and values of one position in every layer."""
  return model.num_layers * 2 * model.num_kv_heads * model.head_dim * _itemsize(model.dtype)


def kv_bytes(model: ModelConfig, context: float) -> float:
  """Keys and values a sequence of `context` positions holds, and a decode step of it reads:
  a layer with a sliding window only its last `sliding_window` positions (the engine's rings,
  `jaxrl.rollout.window_kv`, hold about one call's tokens more)."""
  return kv_bytes_per_token(model) * _attended_positions(model, context) / model.num_layers


def _attended_positions(model: ModelConfig, context: float) -> float:
  """Positions a decode step at `context` attends to, summed over the layers."""
  windowed = len(model.sliding_layers)
  seen = min(context, model.sliding_window) if windowed else 0.0
  return (model.num_layers - windowed) * context + windowed * seen


def _allreduce_seconds(nbytes: float, group: int, bandwidth: float) -> float:
  if group <= 1:
    return 0.0
  return 2 * (group - 1) / group * nbytes / bandwidth + COLLECTIVE_LATENCY_S


# --------------------------------------------------------------------------------- rollout
@dataclasses.dataclass(frozen=True)
class RolloutCost:
  """One rollout instance: `tensor` devices serving `batch` running sequences."""

  tensor: int
  batch: int
  step_seconds: float  # one decode step at the mean context
  samples_per_s: float  # finished responses per second, prefill included
  tail_seconds: float  # latency of the step's expected longest response (as the tail host)
  bulk_tail_seconds: float  # latency of the longest response left after the tail host's share
  memory_bytes: float  # per device


def decode_bytes_flops(
  model: ModelConfig, tensor: int, batch: int, context: float
) -> tuple[float, float]:
  """Bytes read and FLOPs done per device by one decode step (weights + KV of the batch)."""
  kv_shards = min(tensor, model.num_kv_heads)
  nbytes = weight_bytes(model) / tensor + batch * kv_bytes(model, context) / kv_shards
  attn_flops = 4 * model.num_heads * model.head_dim * _attended_positions(model, context)
  return nbytes, batch * (2 * active_params(model) + attn_flops) / tensor


def decode_roofline_seconds(
  model: ModelConfig, acc: Accelerator, tensor: int, batch: int, context: float
) -> float:
  """Ideal decode step: max(bytes / bandwidth, FLOPs / peak), no efficiency or overhead."""
  nbytes, flops = decode_bytes_flops(model, tensor, batch, context)
  return max(nbytes / acc.hbm_bytes_per_s, flops / acc.flops)


def decode_step_seconds(
  model: ModelConfig, acc: Accelerator, tensor: int, batch: int, context: float
) -> float:
  """Modelled decode step: the roofline at fitted efficiencies, plus overhead and all-reduces."""
  nbytes, flops = decode_bytes_flops(model, tensor, batch, context)
  memory_s = nbytes / (acc.hbm_bytes_per_s * acc.decode_efficiency)
  compute_s = flops / (acc.flops * acc.compute_efficiency)
  # Two all-reduces of the residual stream per layer under tensor parallelism.
  act = batch * model.d_model * _itemsize(model.dtype)
  comm_s = 2 * model.num_layers * _allreduce_seconds(act, tensor, acc.link_bytes_per_s)
  return acc.step_overhead_s + max(memory_s, compute_s) + comm_s


def prefill_seconds(model: ModelConfig, acc: Accelerator, tensor: int, tokens: float) -> float:
  attn = 2 * model.num_layers * model.num_heads * model.head_dim * tokens
  flops = tokens * (2 * active_params(model) + attn)
  return flops / (tensor * acc.flops * acc.compute_efficiency)


def rollout_cost(
  model: ModelConfig, acc: Accelerator, tensor: int, batch: int, workload: Workload
) -> RolloutCost | None:
  """Throughput, tail latency and memory of one instance, or None when it does not fit."""
  lengths = workload.lengths()
  context = workload.prompt_len + lengths.mean_position
  kv_shards = min(tensor, model.num_kv_heads)
  longest = workload.prompt_len + workload.response_cap
  # Pages for the running batch at its mean context (+25% for the spread), plus one sequence
  # at full length so the longest response can always finish; logits of the batch in fp32.
  memory = (
    weight_bytes(model) / tensor
    + (1.25 * batch * kv_bytes(model, context) + kv_bytes(model, longest)) / kv_shards
    + batch * model.vocab_size * 4
  )
  if memory > USABLE_MEMORY * acc.memory_bytes:
    return None
  step = decode_step_seconds(model, acc, tensor, batch, context)
  prefill = prefill_seconds(model, acc, tensor, workload.prompt_len)
  if workload.max_staleness == 0:
    # Synchronous steps drain: a long response runs its first `mean` tokens in a full batch
    # and the rest nearly alone.
    alone = decode_step_seconds(model, acc, tensor, 1, workload.prompt_len + lengths.expected_max)

    def latency(length):
      return prefill + lengths.mean * step + max(0.0, length - lengths.mean) * alone
  else:
    # Asynchronous engines keep admitting work: the batch stays full all along.
    def latency(length):
      return prefill + length * step

  return RolloutCost(
    tensor=tensor,
    batch=batch,
    step_seconds=step,
    samples_per_s=1.0 / (lengths.mean * step / batch + prefill),
    tail_seconds=latency(lengths.expected_max),
    bulk_tail_seconds=latency(lengths.bulk_max),
    memory_bytes=memory,
  )


# --------------------------------------------------------------------------------- training
@dataclasses.dataclass(frozen=True)
class TrainCost:
  """One training mesh of `devices` devices of one type."""

  devices: int
  mesh: dict[str, int]
  step_seconds: float
  memory_bytes: float  # per device


def train_cost(
  model: ModelConfig,
  acc: Accelerator,
  devices: int,
  devices_per_node: int,
  network_bytes_per_s: float,
  workload: Workload,
) -> TrainCost | None:
  """The fastest mesh of `devices` devices that fits, or None: fsdp x tensor x expert, or for
  a dense model data x tensor (the training state whole on each data replica), which a tie
  goes to: it moves 2/3 of FSDP's bytes (one gradient all-reduce an update against two
  all-gathers and a reduce-scatter) and on simulated CPU devices trained the demo's learner
  1.6-1.9x as fast (docs/scheduler.md)."""
  tokens = workload.samples_per_step * (workload.prompt_len + workload.lengths().mean)
  best = None
  for tensor in _powers_of_two(min(devices, devices_per_node, model.num_heads)):
    experts = _powers_of_two(devices // tensor) if model.is_moe else [1]
    for expert in experts:
      if devices % (tensor * expert):
        continue
      replicas = devices // (tensor * expert)
      # (data, fsdp): data parallel first (ties keep it), then FSDP.
      shapes = [(replicas, 1)] if not model.is_moe and replicas > 1 else []
      for data, fsdp in [*shapes, (1, replicas)]:
        if not mesh_divides(model, workload, fsdp, tensor, expert, data=data):
          continue
        cost = _train_mesh_cost(
          model, acc, devices, (data, fsdp, tensor, expert), devices_per_node,
          network_bytes_per_s, workload, tokens,
        )  # fmt: skip
        if cost is not None and (best is None or cost.step_seconds < best.step_seconds):
          best = cost
  return best


def _train_mesh_cost(
  model, acc, devices, axes, devices_per_node, network_bytes_per_s, workload, tokens
):
  data, fsdp, tensor, expert = axes
  seq = workload.prompt_len + workload.response_cap
  d, layers = model.d_model, model.num_layers
  per_layer_params = (model.num_params() - model.vocab_size * d) / layers
  # The state is split over every axis but data (whole on each data replica).
  state = TRAIN_STATE_BYTES_PER_PARAM * model.num_params() / (devices // data)
  if data > 1 and state > DATA_PARALLEL_STATE_SHARE * USABLE_MEMORY * acc.memory_bytes:
    return None
  memory = (
    state
    # Rematerialised layer inputs and one layer's live activations, one sequence per device.
    + seq * d * 2 * (layers + 16) / tensor
    + seq * model.vocab_size * 4 / tensor
  )
  if fsdp > 1:
    memory += 2 * 2 * per_layer_params / max(tensor * expert, 1)  # gathered, double-buffered
  if memory > USABLE_MEMORY * acc.memory_bytes:
    return None
  flops = (6 + 2 * workload.extra_forward_passes) * active_params(model) * tokens
  compute_s = flops / (devices * acc.flops * acc.train_mfu)

  def group_bandwidth(span: int) -> float:
    return acc.link_bytes_per_s if span <= devices_per_node else network_bytes_per_s

  # FSDP: all-gather for forward and backward, reduce-scatter of gradients, per update; data
  # parallel: one all-reduce of the gradients (a reduce-scatter and an all-gather), per update.
  # Either overlaps the compute (`max` below).
  shard_bytes = 2 * model.num_params() / (tensor * expert)
  bw = group_bandwidth(devices)
  state_sync_s = 0.0
  if fsdp > 1:
    state_sync_s = workload.updates_per_step * 3 * ((fsdp - 1) / fsdp * shard_bytes / bw)
  if data > 1:
    state_sync_s = workload.updates_per_step * _allreduce_seconds(shard_bytes, data, bw)
  local_tokens = tokens / (data * fsdp)
  passes = 3 + workload.extra_forward_passes  # forward, backward (x2), extra forwards
  tensor_s = (
    passes * 2 * layers * _allreduce_seconds(local_tokens * d * 2, tensor, group_bandwidth(tensor))
  )
  expert_s = 0.0
  if expert > 1:
    moved = local_tokens * model.experts_per_token * d * 2 * (expert - 1) / expert
    expert_s = passes * 2 * layers * moved / group_bandwidth(tensor * expert)
  step = max(compute_s, state_sync_s) + tensor_s + expert_s
  mesh = {"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert}
  return TrainCost(devices=devices, mesh=mesh, step_seconds=step, memory_bytes=memory)


def mesh_divides(
  model: ModelConfig, workload: Workload, fsdp: int, tensor: int, expert: int, data: int = 1
) -> bool:
  """Whether the sharded dimensions split evenly (the logical-axis rules require it)."""
  dims_ok = (
    model.d_model % fsdp == 0
    and model.num_heads % tensor == 0
    and model.num_kv_heads % tensor == 0
    and model.mlp_dim % tensor == 0
    and model.vocab_size % tensor == 0
    and (not model.is_moe or model.num_experts % expert == 0)
  )
  batch = workload.micro_batch_size
  return dims_ok and (batch == 0 or batch % (data * fsdp * expert) == 0)


def weight_sync_seconds(model: ModelConfig, bandwidth: float) -> float:
  """Time to send the policy's weights over one link of `bandwidth` bytes/s."""
  return weight_bytes(model) / bandwidth


def _powers_of_two(limit: int) -> list[int]:
  return [1 << i for i in range(int(math.log2(max(limit, 1))) + 1)]
