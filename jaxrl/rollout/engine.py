"""The rollout-engine interface and its first implementation: static batches over a KV cache.

`StaticEngine` prefills a padded batch of prompts and decodes it inside one jitted while-loop
until every row has stopped. It is the baseline the paged, continuously batched engine replaces;
both answer to `RolloutEngine`, which is all the RL loop knows.

Glossary: b batch rows, p prompt slots, n new-token slots, s cache slots.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.model import ExpertParallel, Model, MoEInputs, Params, cast_params
from jaxrl.rollout.sampling import SamplingParams, filter_width, sample_tokens
from jaxrl.sharding import (
  batch_sharding,
  host_array,
  move_between_devices,
  readable,
  to_devices,
  tree_shardings,
)


@dataclasses.dataclass
class Completion:
  """One finished response and what produced it.

  Attributes:
    prompt_ids: the prompt's token ids.
    token_ids: generated ids, including the stop token if one ended the response.
    logprobs: log-probability of each generated id under the distribution it was sampled from.
    versions: policy version of the weights that produced each token.
    finish_reason: "stop" (a stop token) or "length" (max_new_tokens reached).
    routing: MoE routing trace of the tokens, int32 `[tokens, layers, top_k]`: the experts
      chosen for the input that produced each token (see `RequestRecord.routing`). None for
      dense models and for engines that do not record it (`StaticEngine`).
    prompt_routing: the same for prompt tokens but the last, `[len(prompt) - 1, layers, top_k]`.
  """

  prompt_ids: list[int]
  token_ids: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: str
  routing: np.ndarray | None = None
  prompt_routing: np.ndarray | None = None


class RolloutEngine(Protocol):
  """What the RL loop needs from a generation engine."""

  version: int
  params: Params | None  # on the engine's own mesh, None until update_weights

  def update_weights(self, params: Params, version: int) -> None:
    """Takes new weights (placed onto the engine's own mesh layout) and their version."""

  def release_memory(self) -> None:
    """Drops the engine's weights and caches while it is idle (the learner, sharing its
    devices, needs the memory); the next `update_weights` gives it weights again."""

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams],
    *,
    seed: int,
  ) -> list[Completion]:
    """Generates one completion per prompt, in prompt order."""


class ParamPlacer:
  """Puts weights on an engine's mesh layout in its parameter dtype (`abstract`: the engine
  model's `abstract_params()`): a learner's fp32 master weights become bf16 rollout weights.

  The casts are jitted once, here: a cast made per call traced and compiled again at every
  weight update (Qwen3-0.6B's 310 leaves: 0.4 s of compiling a sync on CPU). Weights on devices
  are cast where they are, then moved, so that a transfer carries the narrow dtype; from other
  devices of this process (a learner's, disaggregated) they move device to device
  (`move_between_devices`: `device_put` alone reads each array whose pieces differ from the
  engine's whole onto the host). `device_to_device` (None: on accelerators) turns that on: on
  CPU the devices' memory is the host's, and `device_put` measured faster there
  (docs/BENCHMARKS.md). Host arrays are cast after the transfer, on the devices, so that no
  host holds a second copy. No donation: when stages share devices, the weights may be the
  learner's own.
  """

  def __init__(self, shardings, abstract: Params, *, device_to_device: bool | None = None):
    self.shardings = shardings
    if device_to_device is None:
      platforms = {d.platform for s in jax.tree.leaves(shardings) for d in s.device_set}
      device_to_device = platforms != {"cpu"}
    self.device_to_device = device_to_device
    self.dtypes = jax.tree.map(lambda a: a.dtype, abstract)
    cast = functools.partial(cast_params, dtypes=self.dtypes)
    self._cast_where_they_are = jax.jit(cast)  # each output in its input's layout
    self._cast_placed = jax.jit(cast, out_shardings=shardings)

  def __call__(self, params: Params) -> Params:
    leaves = jax.tree.leaves(params)
    same_dtypes = [x.dtype for x in leaves] == jax.tree.leaves(self.dtypes)
    if not all(isinstance(x, jax.Array) and x.is_fully_addressable for x in leaves):
      placed = to_devices(params, self.shardings)  # across processes: each places its shards
      return placed if same_dtypes else self._cast_placed(placed)
    cast = params if same_dtypes else self._cast_where_they_are(params)
    move = move_between_devices if self.device_to_device else to_devices
    return move(cast, self.shardings)


def bucket(n: int, minimum: int = 8) -> int:
  """Rounds up to a power of two so that jit shapes repeat across calls."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class StaticEngine:
  """Generation over a static batch: prefill everything, decode until every row stops."""

  def __init__(
    self,
    model: Model,
    mesh: jax.sharding.Mesh,
    rules,
    *,
    eos_id: int,
    pad_id: int,
    max_batch: int | None = None,
  ):
    """`max_batch` caps the rows generated together; more prompts run in successive batches."""
    self.model = model
    self.max_batch = max_batch
    self.mesh = mesh
    self._moe = MoEInputs(ExpertParallel.for_mesh(model.config, mesh))  # see PagedEngine
    self.eos_id = eos_id
    self.pad_id = pad_id
    self.version = -1
    self.params: Params | None = None
    self.param_shardings = tree_shardings(
      model.logical_axes, mesh, rules, jax.tree.map(lambda x: x.shape, model.abstract_params())
    )
    self._placer = ParamPlacer(self.param_shardings, model.abstract_params())
    self._row_sharding = batch_sharding(mesh, rules, 1)
    self._matrix_sharding = batch_sharding(mesh, rules, 2)
    batch_axes = self._row_sharding.spec[0] or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    # Batch buckets are multiples of this so every data shard gets whole rows.
    self._data_size = int(np.prod([mesh.shape[a] for a in batch_axes]))
    # Its outputs, read by the host, are replicated when the mesh spans processes
    # (`jaxrl.sharding.hosts`); within one process the layout is the compiler's choice.
    multi = mesh.is_multi_process
    outputs = {"out_shardings": readable(mesh, self._matrix_sharding)} if multi else {}
    self._generate = jax.jit(self._generate_impl, static_argnames=("max_new", "width"), **outputs)
    self._host = (lambda t: jax.tree.map(host_array, t)) if multi else jax.device_get
    self.num_host_waits = 0  # device-to-host waits: one per batch, after its last token

  def compiled_shapes(self) -> int:
    """Executables compiled so far (one per batch, prompt and response bucket)."""
    return self._generate._cache_size()

  def update_weights(self, params: Params, version: int) -> None:
    self.params = self._placer(params)
    self.version = version

  def release_memory(self) -> None:
    """Drops the weights (each `generate` allocates its own cache and frees it on return)."""
    self.params = None

  def validate(self, prompt_len: int, sampling: SamplingParams) -> None:
    """Raises if a request cannot fit the model's context."""
    limit = self.model.config.max_seq_len
    if prompt_len < 1:
      raise ValueError("An empty prompt was submitted; every prompt needs at least one token.")
    if prompt_len + sampling.max_new_tokens > limit:
      raise ValueError(
        f"Prompt of {prompt_len} tokens plus max_new_tokens={sampling.max_new_tokens} exceeds "
        f"the model's max_seq_len={limit}; shorten the prompt or lower max_new_tokens."
      )

  def generate(self, prompts, sampling, *, seed: int) -> list[Completion]:
    if self.params is None:
      raise RuntimeError("StaticEngine.generate called before update_weights gave it weights.")
    if not prompts:
      return []
    per_row = list(sampling) if isinstance(sampling, Sequence) else [sampling] * len(prompts)
    if len(per_row) != len(prompts):
      raise ValueError(f"Got {len(per_row)} SamplingParams for {len(prompts)} prompts.")
    for prompt, sp in zip(prompts, per_row, strict=True):
      self.validate(len(prompt), sp)
    size = self.max_batch or len(prompts)
    out = []
    for start in range(0, len(prompts), size):
      out += self._generate_batch(
        prompts[start : start + size], per_row[start : start + size], seed + start
      )
    return out

  def _generate_batch(self, prompts, per_row, seed: int) -> list[Completion]:
    rows = len(prompts)
    b = -(-bucket(rows) // self._data_size) * self._data_size
    p = bucket(max(len(x) for x in prompts))
    n = bucket(max(sp.max_new_tokens for sp in per_row))
    prompt_bp = np.full((b, p), self.pad_id, np.int32)
    prompt_len_b = np.ones((b,), np.int32)
    temperature_b = np.ones((b,), np.float32)
    top_k_b = np.zeros((b,), np.int32)
    top_p_b = np.ones((b,), np.float32)
    max_new_b = np.ones((b,), np.int32)  # padding rows stop after one token
    stops = [[*([] if sp.ignore_eos else [self.eos_id]), *sp.stop_token_ids] for sp in per_row]
    stop_rows = np.full((b, max(1, max(map(len, stops)))), -1, np.int32)
    for i, (prompt, sp) in enumerate(zip(prompts, per_row, strict=True)):
      prompt_bp[i, : len(prompt)] = prompt
      prompt_len_b[i] = len(prompt)
      temperature_b[i], top_k_b[i], top_p_b[i] = sp.temperature, sp.top_k, sp.top_p
      max_new_b[i] = sp.max_new_tokens
      stop_rows[i, : len(stops[i])] = stops[i]

    put = lambda x: to_devices(  # noqa: E731
      x, self._row_sharding if x.ndim == 1 else self._matrix_sharding
    )
    tokens_bn, logprobs_bn, lengths_b, stopped_b = self._host(
      self._generate(
        self.params,
        put(prompt_bp),
        put(prompt_len_b),
        put(temperature_b),
        put(top_k_b),
        put(top_p_b),
        put(max_new_b),
        put(stop_rows),
        jax.random.key(seed),
        max_new=n,
        width=filter_width(per_row),
      )
    )
    self.num_host_waits += 1
    out = []
    for i in range(rows):
      length = int(lengths_b[i])
      out.append(
        Completion(
          prompt_ids=list(prompts[i]),
          token_ids=tokens_bn[i, :length].copy(),
          logprobs=logprobs_bn[i, :length].copy(),
          versions=np.full((length,), self.version, np.int32),
          finish_reason="stop" if stopped_b[i] else "length",
        )
      )
    return out

  def _generate_impl(
    self,
    params,
    prompt_bp,
    prompt_len_b,
    temperature_b,
    top_k_b,
    top_p_b,
    max_new_b,
    stop_rows_bs,
    rng,
    *,
    max_new: int,
    width: int,
  ):
    b, p = prompt_bp.shape
    cache = self.model.init_cache(b, p + max_new)
    logits_bpv, cache = self.model.apply(params, prompt_bp, None, cache, moe=self._moe)
    last_logits_bv = jnp.take_along_axis(logits_bpv, (prompt_len_b - 1)[:, None, None], axis=1)[
      :, 0
    ]

    def cond(carry):
      i, _, _, _, _, done_b, _, _ = carry
      return (i < max_new) & ~jnp.all(done_b)

    def body(carry):
      i, logits_bv, cache, tokens_bn, logprobs_bn, done_b, lengths_b, stopped_b = carry
      keys_b = jax.random.split(jax.random.fold_in(rng, i), b)
      token_b, logprob_b = sample_tokens(
        keys_b, logits_bv, temperature_b, top_k_b, top_p_b, filter_width=width
      )
      token_b = jnp.where(done_b, self.pad_id, token_b)
      tokens_bn = tokens_bn.at[:, i].set(token_b)
      logprobs_bn = logprobs_bn.at[:, i].set(jnp.where(done_b, 0.0, logprob_b))
      lengths_b = lengths_b + (~done_b).astype(jnp.int32)
      hit_stop_b = jnp.any(token_b[:, None] == stop_rows_bs, axis=-1) & ~done_b
      stopped_b = stopped_b | hit_stop_b
      done_b = done_b | hit_stop_b | (lengths_b >= max_new_b)
      positions_b1 = (prompt_len_b + i)[:, None]
      logits_b1v, cache = self.model.apply(
        params, token_b[:, None], positions_b1, cache, moe=self._moe
      )
      return i + 1, logits_b1v[:, 0], cache, tokens_bn, logprobs_bn, done_b, lengths_b, stopped_b

    carry = (
      jnp.int32(0),
      last_logits_bv,
      cache,
      jnp.full((b, max_new), self.pad_id, jnp.int32),
      jnp.zeros((b, max_new), jnp.float32),
      jnp.zeros((b,), bool),
      jnp.zeros((b,), jnp.int32),
      jnp.zeros((b,), bool),
    )
    _, _, _, tokens_bn, logprobs_bn, _, lengths_b, stopped_b = jax.lax.while_loop(cond, body, carry)
    return tokens_bn, logprobs_bn, lengths_b, stopped_b
