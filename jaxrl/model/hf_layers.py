"""Per-layer options of a Hugging Face config.json: which layers have a sliding window
(`layer_types`, or a model type's pattern) and which rotate without RoPE (SmolLM3's
`no_rope_layers`); `hf_config` reads with these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.model import hf_defaults as known
from jaxrl.model.hf_rope import get_key
from jaxrl.model.safetensors_io import CheckpointError


def layer_windows(config: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
  """`sliding_window` and `sliding_layers`: every layer for Mistral, Mixtral and Phi-3 when
  config.json has a window; Gemma 3's "sliding_attention" layers (`layer_types`, or by default
  all but every `sliding_window_pattern`-th), and likewise gpt-oss's, OLMo 3's and EXAONE 4's
  (whose pattern may also be a string of L and G, local and global, repeated)."""
  layered = known.LAYERED_WINDOWS.get(model_type)
  if model_type not in known.WINDOW and layered is None:
    return {}
  window = config.get("sliding_window", layered[0] if layered else known.WINDOW[model_type])
  if window is None:
    return {}
  window = get_key({"sliding_window": window}, "sliding_window")
  if window < 1:
    raise CheckpointError(f"config.json: sliding_window={window}; expected null or >= 1.")
  if not layered:
    return {"sliding_window": window, "sliding_layers": tuple(range(num_layers))}
  types = config.get("layer_types")
  pattern = config.get("sliding_window_pattern")
  if types is None and model_type == "exaone4" and isinstance(pattern, str):
    if not pattern or set(pattern) - {"L", "G"}:
      raise CheckpointError(
        f"config.json: sliding_window_pattern={pattern!r}; expected an int or letters L "
        "(local, sliding) and G (global)."
      )
    kind = {"L": "sliding_attention", "G": "full_attention"}
    types = [kind[pattern[i % len(pattern)]] for i in range(num_layers)]
  if types is None:  # one full layer in `pattern`, after the sliding ones
    _, pattern, key = layered
    if key is not None:
      pattern = get_key(config, key, pattern)
    if pattern < 1:
      raise CheckpointError(f"config.json: sliding_window_pattern={pattern}; expected >= 1.")
    types = [
      "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
  kinds = ("sliding_attention", "full_attention")
  if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
    raise CheckpointError(
      f"config.json: layer_types={types!r}; expected one of {kinds} for each of the "
      f"num_hidden_layers={num_layers} layers."
    )
  layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  return {"sliding_window": window, "sliding_layers": layers} if layers else {}


def nope_layers(config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
  """SmolLM3's layers without RoPE: where `no_rope_layers` (a 1 or 0 per layer) says 0, or
  without it every `no_rope_layer_interval`-th layer."""
  flags = config.get("no_rope_layers")
  if flags is None:
    interval = get_key(config, "no_rope_layer_interval", known.NOPE_INTERVAL)
    if interval < 1:
      raise CheckpointError(f"config.json: no_rope_layer_interval={interval}; expected >= 1.")
    flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
  if (
    not isinstance(flags, list)
    or len(flags) < num_layers
    or any(isinstance(f, bool) or f not in (0, 1) for f in flags)
  ):
    raise CheckpointError(
      f"config.json: no_rope_layers={flags!r}; expected a list of 1 (RoPE) or 0 (none) for "
      f"each of the num_hidden_layers={num_layers} layers."
    )
  return tuple(i for i in range(num_layers) if not flags[i])


def exaone4_nope_layers(num_layers: int, sliding_layers: tuple[int, ...]) -> tuple[int, ...]:
  """EXAONE 4's layers without RoPE: with sliding windows, the global (full-attention) ones;
  without, none."""
  if not sliding_layers:
    return ()
  return tuple(i for i in range(num_layers) if i not in sliding_layers)
