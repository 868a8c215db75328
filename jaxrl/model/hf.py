"""Hugging Face checkpoints in and out (the architectures `hf_config.ARCHITECTURES` names).

`load_pretrained` reads a checkpoint directory (or Hub id) one tensor at a time, converts each
from the Hub layout to jaxrl's (`hf_layout`) and places it straight into its sharding, so that
no device ever holds the whole model when a mesh is given and the host holds one tensor beyond
what is already placed. `save_pretrained` writes the Hub names and layout back (what
transformers and vLLM load), gathering one parameter at a time.

Of a multimodal checkpoint (Gemma 3 4B and up: Gemma3ForConditionalGeneration) the language
model is read, and the vision tower left on disk; saved, the model is that language model
(Gemma3ForCausalLM), which transformers and vLLM load as a text-only model.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jaxrl.hub import resolve_pretrained
from jaxrl.model.config import DTYPES, ModelConfig
from jaxrl.model.functional import Model, Params
from jaxrl.model.hf_config import (
  check_same_architecture,
  config_from_hf,
  config_to_hf,
  model_type_of,
  with_dtype,
)
from jaxrl.model.hf_gemma import is_multimodal
from jaxrl.model.hf_layout import (
  Leaf,
  check_coverage,
  fused_expert_layers,
  has_fused_projections,
  has_mxfp4_experts,
  hub_arrays,
  hub_leaves,
  model_type_layout,
  param_paths,
)
from jaxrl.model.safetensors_io import (
  CheckpointError,
  TensorInfo,
  parse_size,
  plan_shards,
  read_header,
  read_tensor,
  write_file,
)
from jaxrl.model.staged_dir import staged_directory
from jaxrl.sharding.rules import STAGE_RULES, Rules, tree_shardings

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "chat_template.jinja",
  "chat_template.json",
  "vocab.json",
  "merges.txt",
  "vocab.txt",
  "tokenizer.model",
)
"""Files save_pretrained copies from its source (besides `*.tiktoken`)."""
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Buffers some older checkpoints saved beside the weights; RoPE is recomputed, never read.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_COMPARE_BYTES = 64 << 20  # rows compared at a time when checking a tied head
# Where a multimodal checkpoint keeps its language model: transformers 4's layout (the Hub's
# Gemma 3 files) and transformers 5's.
_LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
_LANGUAGE_MODEL_HEADS = ("language_model.lm_head.weight", "lm_head.weight")

log = logging.getLogger(__name__)

# -- loading -----------------------------------------------------------------------------------


def _read_json(root: str, name: str) -> dict:
  path = os.path.join(root, name)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(
      f"{path}: not found; a Hugging Face checkpoint directory holds config.json and "
      "model.safetensors (or shards with model.safetensors.index.json)."
    ) from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e}).") from None


def _tensor_index(root: str) -> tuple[dict[str, TensorInfo], str]:
  """Every tensor of the checkpoint in `root` by name, and the file that says where they are."""
  index_path, single = os.path.join(root, INDEX_FILE), os.path.join(root, SINGLE_FILE)
  if os.path.exists(index_path):
    weight_map = _read_json(root, INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index_path}: has no weight_map naming the tensors' shards.")
    files = list(dict.fromkeys(weight_map.values()))
    if os.path.exists(single) and not all(os.path.exists(os.path.join(root, f)) for f in files):
      # A stale index: transformers' re-save of a sharded checkpoint as one file deletes the
      # shards but not the index, and transformers then reads the one file. (With every shard
      # present the index wins: a re-save the other way round leaves an old single file.)
      return read_header(single), single
    tensors: dict[str, TensorInfo] = {}
    for file in files:
      shard = os.path.join(root, file)
      if not os.path.exists(shard):
        first = next(name for name, f in weight_map.items() if f == file)
        raise CheckpointError(
          f"{index_path}: shard {file} (holding {first} and others) is missing from {root}."
        )
      tensors |= read_header(shard)
    for name, file in weight_map.items():
      if name not in tensors or os.path.basename(tensors[name].file) != file:
        raise CheckpointError(
          f"{os.path.join(root, file)}: tensor {name} is missing ({INDEX_FILE} places it there)."
        )
    return tensors, index_path
  if os.path.exists(single):
    return read_header(single), single
  pickles = glob.glob(os.path.join(root, "pytorch_model*.bin*"))
  if pickles:
    raise CheckpointError(
      f"{root}: holds only PyTorch pickles ({os.path.basename(sorted(pickles)[0])}); jaxrl reads "
      "safetensors only and never unpickles. Convert it once with transformers: "
      "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)."
    )
  raise CheckpointError(f"{root}: has no {SINGLE_FILE} and no {INDEX_FILE}.")


def language_model_tensors(tensors: Mapping[str, TensorInfo], where: str) -> dict[str, TensorInfo]:
  """A multimodal checkpoint's language-model tensors under a text model's names
  (`model.layers.0...`, `lm_head.weight`); the others (vision tower, projector) are left out,
  and counted in a log line."""
  text, left_out = {}, []
  for name, info in tensors.items():
    for prefix in _LANGUAGE_MODEL_PREFIXES:
      if name.startswith(prefix):
        text["model." + name.removeprefix(prefix)] = info
        break
    else:
      if name in _LANGUAGE_MODEL_HEADS:
        text["lm_head.weight"] = info
      else:
        left_out.append(name)
  if not text:
    raise CheckpointError(
      f"{where}: no language-model tensor (named {_LANGUAGE_MODEL_PREFIXES[0]}* or "
      f"{_LANGUAGE_MODEL_PREFIXES[1]}*) in this multimodal checkpoint."
    )
  if left_out:
    log.info(
      "%s: reading the language model; %d tensors of the other parts (%s, ...) are not part "
      "of it and stay on disk.", where, len(left_out), sorted(left_out)[0],
    )  # fmt: skip
  return text


def _check_names(cfg: ModelConfig, leaves, tensors: dict[str, TensorInfo], where: str) -> None:
  """Raises for a tensor the model has no parameter for, and for an untied head in a checkpoint
  whose config.json ties it."""
  expected = {name for leaf in leaves for name in leaf.names}
  if cfg.tie_embeddings and "lm_head.weight" in tensors:
    expected.add("lm_head.weight")
    if "model.embed_tokens.weight" in tensors:  # else reading it reports it missing
      _check_tied(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])
  unexpected = [n for n in tensors if n not in expected and not _IGNORED.fullmatch(n)]
  if unexpected:
    name = sorted(unexpected)[0]
    more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    what = "a bias" if name.endswith(".bias") else "a tensor"
    raise CheckpointError(
      f"{tensors[name].file}: unexpected tensor {name}{more}: jaxrl's {model_type_of(cfg)} "
      f"model as config.json describes it has no such parameter ({what} it would ignore). "
      f"Tensors listed by {where}."
    )
  if not cfg.tie_embeddings and "lm_head.weight" not in tensors:
    raise CheckpointError(
      f"{where}: tensor lm_head.weight is missing, but config.json has "
      "tie_word_embeddings=false; set it to true if the head shares the embedding."
    )


def _check_tied(embed: TensorInfo, head: TensorInfo) -> None:
  if (embed.shape, embed.dtype) != (head.shape, head.dtype):
    raise CheckpointError(
      f"{head.file}: tensor lm_head.weight ({head.dtype} {list(head.shape)}) is not the "
      f"embedding ({embed.dtype} {list(embed.shape)}), but config.json ties them."
    )
  rows = max(1, _COMPARE_BYTES // max(1, embed.nbytes // max(1, embed.shape[0])))
  for start in range(0, embed.shape[0], rows):
    span = (start, min(start + rows, embed.shape[0]))
    if not np.array_equal(read_tensor(embed, span), read_tensor(head, span)):
      raise CheckpointError(
        f"{head.file}: tensor lm_head.weight differs from model.embed_tokens.weight, but "
        "config.json has tie_word_embeddings=true; set it to false to load an untied head."
      )


def _reader(leaf: Leaf, tensors: Mapping[str, TensorInfo], where: str):
  def read(i: int, rows: tuple[int, int] | None = None) -> np.ndarray:
    name, shape = leaf.names[i], leaf.shapes[i]
    info = tensors.get(name)
    if info is None:
      raise CheckpointError(f"{where}: tensor {name} is missing; config.json's model needs it.")
    if info.shape != shape:
      raise CheckpointError(
        f"{info.file}: tensor {name} has shape {list(info.shape)}, but config.json gives "
        f"{list(shape)}."
      )
    return read_tensor(info, rows)

  return read


def _place(host: np.ndarray, sharding, dtype: np.dtype) -> jax.Array:
  """The array on its devices, each device given only its slice."""
  if sharding is None:
    return jax.device_put(np.asarray(host, dtype))
  return jax.make_array_from_callback(
    host.shape, sharding, lambda index: np.asarray(host[index], dtype)
  )


def load_pretrained(
  path: str,
  *,
  dtype: str = "bfloat16",
  mesh: jax.sharding.Mesh | None = None,
  rules: Rules | None = None,
) -> tuple[Model, Params]:
  """Loads a Hugging Face checkpoint (an architecture of `hf_config.ARCHITECTURES`) as a Model
  and params.

  Args:
    path: a checkpoint directory, or a Hub id (see `jaxrl.hub.resolve_pretrained`).
    dtype: "bfloat16" or "float32": the parameter and compute dtype of the returned model;
      tensors stored in another dtype are converted as they are read.
    mesh: place every parameter straight into its sharding on this mesh; None puts them on the
      default device.
    rules: the logical-axis rules of the sharding (default: the training rules).

  Returns:
    (model, params) with `model.apply(params, tokens)` giving the checkpoint's logits.

  Raises:
    CheckpointError: naming the file and the tensor or key: an unsupported model type or
      option, a missing shard or tensor, a tensor the model has no parameter for, a shape that
      disagrees with config.json, or PyTorch pickles instead of safetensors.
    jaxrl.hub.PretrainedNotFound: `path` is neither a directory nor a Hub id that resolves.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
  root = resolve_pretrained(path)
  hub_config = _read_json(root, "config.json")
  cfg = config_from_hf(hub_config)
  cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
  tensors, where = _tensor_index(root)
  if is_multimodal(hub_config):
    tensors = language_model_tensors(tensors, where)
  leaves = hub_leaves(
    cfg,
    fused_expert_layers(cfg, tensors),
    has_fused_projections(tensors),
    mxfp4_experts=cfg.moe_biases and has_mxfp4_experts(tensors),
    **model_type_layout(hub_config.get("model_type")),
  )
  _check_names(cfg, leaves, tensors, where)
  model = Model(cfg)
  abstract = model.abstract_params()
  check_coverage(leaves, abstract)
  shardings = None
  if mesh is not None:
    rules = rules or STAGE_RULES["train"]
    shardings = param_paths(tree_shardings(model.logical_axes, mesh, rules, abstract))
  target = np.dtype(jnp.dtype(dtype))
  loaded = {}
  total = sum(tensors[n].nbytes for leaf in leaves for n in leaf.names if n in tensors)
  with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc="load", disable=None) as bar:
    for leaf in leaves:
      host = leaf.load(_reader(leaf, tensors, where), target)
      loaded[leaf.path] = _place(host, shardings and shardings[leaf.path], target)
      del host  # before the next tensor is read: one tensor on the host at a time
      bar.update(sum(tensors[n].nbytes for n in leaf.names))
  params = jax.tree_util.tree_map_with_path(
    lambda path, _: loaded.pop(tuple(key.key for key in path)), abstract
  )
  return model, params


# -- saving ------------------------------------------------------------------------------------


def _write_json(path: str, value: Any) -> None:
  with open(path, "w") as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write("\n")


def _copy_files(src: str, dst: str, names) -> list[str]:
  """Copies those of `names` that `src` has into `dst`; returns their names."""
  copied = []
  for name in names:
    if os.path.exists(os.path.join(src, name)):
      shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
      copied.append(name)
  return copied


def _tokenizer_files(src: str) -> list[str]:
  tiktoken = map(os.path.basename, glob.glob(os.path.join(src, "*.tiktoken")))
  return [*TOKENIZER_FILES, *tiktoken]


def _written_by_save(name: str) -> bool:
  """Whether `name` is a file `save_pretrained` writes (a rewrite replaces or removes these and
  keeps any other file of the directory)."""
  return (
    name in (SINGLE_FILE, INDEX_FILE, "config.json", "generation_config.json", *TOKENIZER_FILES)
    or bool(_SHARD_NAME.fullmatch(name))
    or name.endswith(".tiktoken")
  )


def save_pretrained(
  model: Model,
  params: Params,
  path: str,
  *,
  max_shard_size: int | str = "5GB",
  source: str | None = None,
  dtype: str | None = None,
  tokenizer_source: str | Literal[False] | None = None,
  token_ids: Mapping[str, int] | None = None,
) -> None:
  """Writes `params` as a Hugging Face checkpoint that transformers and vLLM load.

  The directory is written whole or not at all (`staged_dir`): a process killed while saving
  leaves an earlier save at `path` as it was. Files of an earlier save that this one does not
  write (shards of another split, tokenizer files the new source lacks) are gone afterwards;
  files no save writes (a README) are kept.

  Args:
    model: the model the params belong to.
    params: its parameters, on any devices and shardings; gathered one at a time.
    path: the output directory (created if missing).
    max_shard_size: bytes per safetensors file (an int, or e.g. "5GB"); more than one file
      writes model-0000i-of-0000n.safetensors and model.safetensors.index.json.
    source: the checkpoint the model came from (directory or Hub id): its config.json (with
      the dtype updated), generation_config.json and tokenizer files are copied (of a
      multimodal source, the language model's config.json is written, with the source's token
      ids). None writes a config.json from the model's config (architecture from its options)
      and a minimal generation_config.json.
    dtype: "bfloat16" or "float32" for the written tensors; None keeps the parameter dtype.
    tokenizer_source: a directory (or Hub id) whose tokenizer files are copied instead of
      `source`'s (a run whose tokenizer is not its checkpoint's); False copies none.
    token_ids: `bos_token_id`, `eos_token_id`, `pad_token_id` for config.json and the
      generation config where `source` does not set them (without a source, the model's config
      knows no token ids: pass the tokenizer's, or generation never stops at an EOS).

  Raises:
    ValueError: a `source` whose config.json describes another model, or a model no Hub
      architecture holds.
  """
  cfg = model.config
  dtype = dtype or cfg.param_dtype
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
  src = resolve_pretrained(source) if source is not None else None
  if src is not None:
    hub_config = _read_json(src, "config.json")
    where = os.path.join(src, "config.json")
    check_same_architecture(cfg, config_from_hf(hub_config), where)
    if is_multimodal(hub_config):  # the language model alone is written
      ids = {k: hub_config[k] for k in _TOKEN_ID_KEYS if hub_config.get(k) is not None}
      hub_config = config_to_hf(cfg, dtype) | ids
    else:
      hub_config = with_dtype(hub_config, dtype)
  else:
    hub_config = config_to_hf(cfg, dtype)
  for key, value in (token_ids or {}).items():
    if key not in _TOKEN_ID_KEYS:
      raise ValueError(f"token_ids: {key!r} is not one of {_TOKEN_ID_KEYS}.")
    if hub_config.get(key) is None:
      hub_config[key] = int(value)
  if tokenizer_source is None:
    tokenizer_source = src or False
  elif tokenizer_source is not False:
    tokenizer_source = resolve_pretrained(tokenizer_source)
  # Phi-3 checkpoints fuse q/k/v and gate/up; a model saved as Phi-3 (with a Phi-3 source) too.
  model_type = hub_config.get("model_type")
  leaves = hub_leaves(cfg, fused_projections=model_type == "phi3", **model_type_layout(model_type))
  check_coverage(leaves, params)
  target = np.dtype(jnp.dtype(dtype))
  shapes = {n: s for leaf in leaves for n, s in zip(leaf.names, leaf.shapes, strict=True)}
  sizes = {n: math.prod(s) * target.itemsize for n, s in shapes.items()}
  shards = plan_shards(sizes, parse_size(max_shard_size))
  n = len(shards)
  files = (
    [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
  )
  arrays = hub_arrays(leaves, params)
  with staged_directory(path, _written_by_save) as out:
    with tqdm.tqdm(
      total=sum(sizes.values()), unit="B", unit_scale=True, desc="save", disable=None
    ) as bar:
      for file, names in zip(files, shards, strict=True):
        written = write_file(
          os.path.join(out, file), [(name, target, shapes[name]) for name in names], arrays
        )
        bar.update(written)
    if n > 1:
      weight_map = {name: file for file, names in zip(files, shards, strict=True) for name in names}
      index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
      _write_json(os.path.join(out, INDEX_FILE), index)
    _write_json(os.path.join(out, "config.json"), hub_config)
    if tokenizer_source:
      _copy_files(tokenizer_source, out, _tokenizer_files(tokenizer_source))
    if not (src and _copy_files(src, out, ["generation_config.json"])):
      ids = {k: hub_config[k] for k in _TOKEN_ID_KEYS if hub_config.get(k) is not None}
      _write_json(os.path.join(out, "generation_config.json"), {"_from_model_config": True, **ids})
