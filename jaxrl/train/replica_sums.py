"""Gradient sums kept per data-parallel replica until the update applies them.

On a mesh whose only axis of more than one device is `data` (the planner's data-parallel
training meshes for dense models, `jaxrl.scheduler.cost`), every replica holds the whole
training state and its own rows of each micro-batch. A micro-step that returns its gradients
laid out like the parameters (replicated) makes XLA all-reduce the whole gradient in every
micro-step: m micro-batches an update, m all-reduces. Here each replica adds its own gradients
(and metric sums) into its slice of `[replicas, ...]` sums, a `shard_map` over `data` with no
collective in it, and the apply step sums the slices: one all-reduce an update, the one the
cost model counts. The per-replica sums take what the replicated sums took: one
parameter-sized buffer a device. The padded path (`train.pack_length=0`: one update program, a
scan over the micro-batches) runs its whole scan per replica and adds the replicas' sums once,
after it (`summed_over_replicas`).

The sum is the same; its order is not (each replica's micro-batches first, then the replicas):
float32 rounding differs from the per-micro-step all-reduce, nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.model import ModelConfig

AXIS = "data"


def replicas(config: ModelConfig, mesh: jax.sharding.Mesh) -> int:
  """Replicas whose gradient sums stay apart until the apply step: the size of `data` where it
  is the mesh's only axis of more than one device and the model is dense; else 0 (the sums are
  laid out like the parameters; an MoE layer's own `shard_map` splits tokens over more axes)."""
  sizes = dict(mesh.shape)
  if config.is_moe or sizes.get(AXIS, 1) < 2:
    return 0
  if any(size > 1 for axis, size in sizes.items() if axis != AXIS):
    return 0
  return sizes[AXIS]


def sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """The sums' layout: one slice of the leading `[replicas]` axis on each replica."""
  return NamedSharding(mesh, PartitionSpec(AXIS))


def zeros(sums, count: int):
  """Zeros of `[count, ...]` for every leaf of `sums` (the sums of one replica)."""
  return jax.tree.map(lambda x: jnp.zeros((count, *x.shape), x.dtype), sums)


def per_replica(step, mesh: jax.sharding.Mesh):
  """`step(params, ref_params, sums, micro, num_tokens, num_seqs)`, adding one micro-batch's
  gradients and metrics into `sums`, run by every replica on its rows of `micro` into its own
  slice of `[replicas, ...]` sums (parameters and counts whole on each). The result takes the
  learner's micro-step arguments (`placement` is an MoE argument, always None here)."""
  rows, whole = PartitionSpec(AXIS), PartitionSpec()

  def local(params, ref_params, sums, micro, num_tokens, num_seqs):
    own = jax.tree.map(lambda x: x[0], sums)
    own = step(params, ref_params, own, micro, num_tokens, num_seqs)
    return jax.tree.map(lambda x: x[None], own)

  mapped = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(whole, whole, rows, rows, whole, whole),
    out_specs=rows,
    # Not written for varying-across-replicas typing (the log-probs' scans carry values that
    # vary over `data` only after the first block); nothing here is summed across replicas.
    check_vma=False,
  )

  def micro_step(params, ref_params, sums, micro, num_tokens, num_seqs, placement=None):
    if placement is not None:
      raise ValueError("Per-replica gradient sums are for dense models; got an expert placement.")
    return mapped(params, ref_params, sums, micro, num_tokens, num_seqs)

  return micro_step


def summed_over_replicas(sum_micro_batches, mesh: jax.sharding.Mesh):
  """`sum_micro_batches(params, ref_params, micro_m, num_tokens, num_seqs)`, returning sums
  over a stack of padded micro-batches (`micro_m`'s leaves `[m, rows, ...]`, in a scan), run
  by every replica on its rows of each micro-batch, the results added across replicas once at
  the end (float32, back in each leaf's dtype): one all-reduce an update instead of one in
  every step of the scan. Parameters and counts whole on each replica."""
  rows, whole = PartitionSpec(None, AXIS), PartitionSpec()

  def local(params, ref_params, micro_m, num_tokens, num_seqs):
    sums = sum_micro_batches(params, ref_params, micro_m, num_tokens, num_seqs)
    added = lambda x: jax.lax.psum(x.astype(jnp.float32), AXIS).astype(x.dtype)  # noqa: E731
    return jax.tree.map(added, sums)

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(whole, whole, rows, whole, whole),
    out_specs=whole,
    check_vma=False,  # as in `per_replica`; the sums are replicated by their psum
  )


def total(sums):
  """The replicas' sums added up (float32, back in each leaf's dtype): the update's one
  all-reduce."""
  return jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32), axis=0).astype(x.dtype), sums)
