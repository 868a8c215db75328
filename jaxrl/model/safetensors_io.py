"""Reading and writing safetensors files one tensor at a time, without torch.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. Reading a tensor is one seek and one read into
a fresh numpy buffer (bf16 as `ml_dtypes.bfloat16`, which numpy lacks), so a loader holds at
most the tensor it is converting, never the file mapped whole. Writing streams tensors in
header order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

# safetensors dtype names <-> numpy dtypes (the floating types checkpoints use, and the bytes
# of gpt-oss's MXFP4 experts, `jaxrl.model.mxfp4`).
NUMPY_DTYPES = {
  "F64": np.dtype("<f8"),
  "F32": np.dtype("<f4"),
  "F16": np.dtype("<f2"),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "U8": np.dtype("u1"),
}
SAFETENSORS_DTYPES = {v: k for k, v in NUMPY_DTYPES.items()}

# safetensors refuses headers above 100 MB; so do we, before allocating one.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_ALIGN = 8


class CheckpointError(ValueError):
  """A checkpoint jaxrl cannot read or write; the message names the file and the tensor or key."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lives: its file, dtype (safetensors name), shape and absolute byte range."""

  file: str
  name: str
  dtype: str
  shape: tuple[int, ...]
  start: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def read_header(path: str) -> dict[str, TensorInfo]:
  """The tensors of one safetensors file, by name (reads only the header).

  Raises:
    CheckpointError: a missing or malformed file, an unsupported dtype, or a byte range that
      does not fit the tensor's shape or the file.
  """
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header).")
      (header_len,) = struct.unpack("<Q", head)
      if header_len > min(_MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{path}: not a safetensors file (header length {header_len}).")
      header = json.loads(f.read(header_len))
  except FileNotFoundError:
    raise CheckpointError(f"{path}: no such file.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e}).") from None
  data_start = 8 + header_len
  infos = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    dtype, shape = entry.get("dtype"), tuple(entry.get("shape", ()))
    if dtype not in NUMPY_DTYPES:
      raise CheckpointError(
        f"{path}: tensor {name} has dtype {dtype}; jaxrl reads {sorted(NUMPY_DTYPES)}."
      )
    begin, end = entry["data_offsets"]
    want = int(np.prod(shape, dtype=np.int64)) * NUMPY_DTYPES[dtype].itemsize
    if end - begin != want or data_start + end > size:
      raise CheckpointError(
        f"{path}: tensor {name} ({dtype} {list(shape)}) has byte range [{begin}, {end}), which "
        f"does not hold its {want} bytes or runs past the file's end; the file is damaged."
      )
    infos[name] = TensorInfo(path, name, dtype, shape, data_start + begin, data_start + end)
  return infos


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
  """Reads one tensor (or rows [a, b) of its first dimension) into a new numpy array."""
  dtype = NUMPY_DTYPES[info.dtype]
  shape, start, end = info.shape, info.start, info.end
  if rows is not None:
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    shape = (rows[1] - rows[0], *shape[1:])
    start, end = info.start + rows[0] * row_bytes, info.start + rows[1] * row_bytes
  out = np.empty(end - start, np.uint8)
  with open(info.file, "rb") as f:
    f.seek(start)
    view, done = memoryview(out), 0
    while done < out.size:
      n = f.readinto(view[done:])
      if not n:
        raise CheckpointError(f"{info.file}: tensor {info.name} ends early; the file is truncated.")
      done += n
  return out.view(dtype).reshape(shape)


def write_file(
  path: str,
  specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
  arrays: Iterator[tuple[str, np.ndarray]],
) -> int:
  """Writes one safetensors file, pulling its tensors one at a time.

  Args:
    path: the file to write.
    specs: (name, dtype, shape) of each tensor, in the order `arrays` yields them.
    arrays: yields (name, array) in `specs` order; each is converted to its spec's dtype.

  Returns:
    The bytes of tensor data written.
  """
  specs = list(specs)
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, dtype, shape in specs:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {
      "dtype": SAFETENSORS_DTYPES[np.dtype(dtype)],
      "shape": list(shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-(8 + len(text)) % _ALIGN)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name, dtype, shape in specs:
      got_name, array = next(arrays)
      if got_name != name or tuple(array.shape) != tuple(shape):
        raise AssertionError(f"{path}: expected {name} {shape}, got {got_name} {array.shape}.")
      array = np.ascontiguousarray(array, dtype=dtype)
      f.write(array.reshape(-1).view(np.uint8).data)
  return offset


def parse_size(size: int | str) -> int:
  """Bytes from an int or a string such as "5GB", "500MB" or "2GiB" (as transformers reads)."""
  if isinstance(size, int) and not isinstance(size, bool):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
  if not match:
    raise ValueError(f"max_shard_size={size!r}: use bytes (an int) or a size such as '5GB'.")
  number, unit = float(match.group(1)), (match.group(2) or "B").upper()
  powers = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
  powers.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
  return int(number * powers[unit])


def plan_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
  """Groups tensor names, in order, into shards of at most `max_shard_size` bytes each (a tensor
  larger than that gets a shard of its own)."""
  shards: list[list[str]] = [[]]
  used = 0
  for name, nbytes in sizes.items():
    if shards[-1] and used + nbytes > max_shard_size:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += nbytes
  return shards
