"""Where a pretrained model's files are: a local directory, or a Hugging Face Hub id.

One place resolves both, so the checkpoint loader and the tokenizer loader agree on what a
"path" may be. Resolving a Hub id downloads with `huggingface_hub.snapshot_download` (the `hf`
extra) into its usual cache; a machine without access to the Hub can only use local directories.
"""

from __future__ import annotations

import os
import re

# What a model needs from a Hub repository: weights, configs, tokenizer and chat template.
PRETRAINED_PATTERNS = (
  "*.json",
  "*.safetensors",
  "*.jinja",
  "*.txt",
  "*.model",
  "*.tiktoken",
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class PretrainedNotFound(FileNotFoundError):
  """A path that is neither a local directory nor a Hub id that could be fetched."""


def resolve_pretrained(path_or_id: str, *, revision: str | None = None) -> str:
  """Returns a local directory holding the files of `path_or_id`.

  Args:
    path_or_id: a local directory, or a Hub id such as "Qwen/Qwen3-0.6B" (downloaded once into
      the Hugging Face cache, weights, configs and tokenizer files only).
    revision: a Hub branch, tag or commit; ignored for a local directory.

  Raises:
    PretrainedNotFound: the path is not a directory and not a Hub id, or the download failed;
      the message says which and what to do.
  """
  path = os.path.expanduser(str(path_or_id))
  if os.path.isdir(path):
    return path
  if os.path.exists(path):
    raise PretrainedNotFound(
      f"{path} is a file; pass the directory that holds config.json, the *.safetensors "
      "files and the tokenizer files."
    )
  if not _HUB_ID.match(str(path_or_id)) or str(path_or_id).startswith((".", "/", "~")):
    raise PretrainedNotFound(
      f"{path_or_id}: no such directory, and not a Hub id of the form 'org/name'."
    )
  try:
    from huggingface_hub import snapshot_download
  except ImportError:
    raise PretrainedNotFound(
      f"{path_or_id}: no such local directory; to fetch it from the Hugging Face Hub install "
      "the hf extra: pip install 'jaxrl[hf]'."
    ) from None
  try:
    return snapshot_download(
      repo_id=str(path_or_id), revision=revision, allow_patterns=list(PRETRAINED_PATTERNS)
    )
  except Exception as e:  # network, authentication, unknown repository: all end the same way
    reason = " ".join(str(e).split())  # one line: the Hub's messages span several
    raise PretrainedNotFound(
      f"{path_or_id}: no such local directory, and fetching it from the Hugging Face Hub "
      f"failed ({type(e).__name__}: {reason}). Check the id and your network, or download it "
      "yourself and pass the directory."
    ) from None
