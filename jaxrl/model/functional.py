"""The model as pure functions over a params pytree (what jit, sharding and checkpoints see).

`Model` holds the static half (config and NNX graph definition); parameters travel separately as
a nested dict of arrays, so the rollout engine, the learner and the weight store can place,
transfer and save them without touching NNX objects.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.kernels.partitioning import KernelMesh
from jaxrl.model.cache import LayerCache, init_cache
from jaxrl.model.config import ModelConfig
from jaxrl.model.moe import MoEInputs
from jaxrl.model.transformer import LMHead, Transformer

Params = dict


def cast_params(params: Params, dtypes: Params, *, copy: bool = False) -> Params:
  """`params` with each leaf in the dtype at its place in `dtypes` (a tree of dtypes shaped like
  the parameters: an engine's rollout dtype, a learner's master weights' own). Traceable: jit
  it once and keep it (a jit made per call traces and compiles again at every call). With
  `copy`, a leaf already in its dtype is copied too, so that the result shares no buffer with
  `params` (a copy a store keeps while the original is donated)."""
  return jax.tree.map(
    lambda x, dt: jnp.copy(x) if copy and x.dtype == dt else x.astype(dt), params, dtypes
  )


def copy_params(params: Params, dtypes: Params | None = None) -> Params:
  """A copy of `params` in `dtypes` (None: their own) made where they are, in their layout, as
  new buffers (`cast_params` with `copy`); one compilation per tree of shapes and dtypes."""
  dtypes = jax.tree.map(lambda x: x.dtype, params) if dtypes is None else dtypes
  treedef = jax.tree.structure(dtypes)
  return _compiled_copy(params, (treedef, tuple(jnp.dtype(d) for d in jax.tree.leaves(dtypes))))


@functools.partial(jax.jit, static_argnums=1)
def _compiled_copy(params: Params, dtypes_key) -> Params:
  return cast_params(params, jax.tree.unflatten(*dtypes_key), copy=True)


class Model:
  """Pure-function view of `Transformer` for one `ModelConfig`."""

  def __init__(self, config: ModelConfig):
    self.config = config
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    self.graphdef, self._abstract_state = nnx.split(abstract)

  # Everything else a Model holds is made from its config: models of equal configs compute
  # the same functions, and share their traces and programs (`compile_ahead.shared_function`).
  def __eq__(self, other) -> bool:
    return type(other) is type(self) and other.config == self.config

  def __hash__(self) -> int:
    return hash(self.config)

  def init(self, seed: int | jax.Array) -> Params:
    """Fresh parameters; jit it with `out_shardings` to build them already sharded."""
    key = (
      seed
      if jax.dtypes.issubdtype(jax.numpy.asarray(seed).dtype, jax.dtypes.prng_key)
      else jax.random.key(seed)
    )
    module = Transformer(self.config, rngs=nnx.Rngs(key))
    return nnx.to_pure_dict(nnx.state(module))

  def abstract_params(self) -> Params:
    """Parameters as ShapeDtypeStructs (no memory touched)."""
    return nnx.to_pure_dict(self._abstract_state)

  @functools.cached_property
  def logical_axes(self) -> Params:
    """The logical axes of every parameter, as a tree shaped like the params."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    axes = jax.tree.map(
      lambda v: v.get_metadata()["logical_axes"], self._abstract_state, is_leaf=is_var
    )
    return nnx.to_pure_dict(axes)

  def apply(
    self,
    params: Params,
    tokens_bt: jax.Array,
    positions_bt: jax.Array | None = None,
    cache: tuple | None = None,
    return_routing: bool = False,
    moe: MoEInputs | None = None,
    return_hidden: bool = False,
    segment_ids_bt: jax.Array | None = None,
    return_moe_counts: bool = False,
    activation_sharding: jax.sharding.Sharding | None = None,
    kernel_mesh: KernelMesh | None = None,
  ):
    """Forward pass; returns (logits_btv in fp32, updated cache or None[, routing_btlk][,
    moe counts]).

    With `return_routing`, also the expert ids every token was routed to per layer (MoE), or
    None for a dense model; `moe` selects expert parallelism, routing replay and an expert
    placement; `return_hidden` gives the final hidden states instead of the logits (for
    `lm_head` applied in chunks); `segment_ids_bt` packs several sequences in a row (training,
    or a packed prefill); `return_moe_counts` adds the assignments the MoE layers routed and
    dropped for capacity; `activation_sharding` pins the residual stream between blocks (the
    learner's rows over its batch axes); `kernel_mesh` runs the attention kernels on each
    device's rows and heads; see `Transformer.__call__`.
    """
    state = jax.tree.map(lambda x: x, self._abstract_state)
    nnx.replace_by_pure_dict(state, params)
    module = nnx.merge(self.graphdef, state)
    return module(
      tokens_bt,
      positions_bt,
      cache,
      return_routing,
      moe,
      return_hidden,
      segment_ids_bt,
      return_moe_counts,
      activation_sharding,
      kernel_mesh,
    )

  def lm_head(self, params: Params) -> LMHead:
    """The LM head of `params` as stored: the embedding when tied, else `lm_head_dv`."""
    if self.config.tie_embeddings:
      return LMHead(params["embed_vd"], vocab_major=True)
    return LMHead(params["lm_head_dv"], vocab_major=False)

  def init_cache(self, batch: int, max_len: int) -> tuple[LayerCache, ...]:
    return init_cache(self.config, batch, max_len)
