"""A directory written whole or not at all (`save_pretrained`'s output).

The new contents are written into a staging directory beside the target, then swapped in with
two renames on the same filesystem. A process killed while writing leaves the previous
directory as it was (and a hidden `.NAME.partial-*` beside it, removed by the next successful
write); killed between the two renames, the previous directory survives as `.NAME.replaced-*`
and the new one, complete, as `.NAME.partial-*`. One writer per directory at a time.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
from collections.abc import Callable, Iterator


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst)  # no bytes copied; the old name goes away with the old directory
  except OSError:
    shutil.copy2(src, dst)


def _carry_over(old: str, new: str, written_here: Callable[[str], bool]) -> None:
  """Puts the entries of `old` that this kind of write does not produce into `new` (a user's
  README, a subdirectory): a rewrite removes only what it would itself write."""
  for name in os.listdir(old):
    if written_here(name) or os.path.exists(os.path.join(new, name)):
      continue
    src, dst = os.path.join(old, name), os.path.join(new, name)
    if os.path.isdir(src) and not os.path.islink(src):
      shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    elif os.path.islink(src):
      os.symlink(os.readlink(src), dst)
    else:
      _link_or_copy(src, dst)


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike, written_here: Callable[[str], bool]) -> Iterator[str]:
  """Yields an empty directory to write into; when the block ends without an error it replaces
  `path` (created if missing). Entries of an existing `path` for which `written_here(name)` is
  false are kept; the others are replaced by what the block wrote (a file it did not write
  again is gone, as it should be: it belonged to the previous contents). On an error `path`
  is untouched and the staging directory removed.

  Raises:
    NotADirectoryError: `path` exists and is not a directory.
  """
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise NotADirectoryError(f"{path} exists and is not a directory: choose a directory path.")
  parent, base = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  staging = os.path.join(parent, f".{base}.partial-{uuid.uuid4().hex}")
  os.mkdir(staging)  # not mkdtemp: its 0700 would stay on the result (umask's mode instead)
  try:
    yield staging
    if os.path.isdir(path):
      _carry_over(path, staging, written_here)
      replaced = os.path.join(parent, f".{base}.replaced-{uuid.uuid4().hex}")
      os.rename(path, replaced)
      os.rename(staging, path)
      shutil.rmtree(replaced, ignore_errors=True)
    else:
      os.rename(staging, path)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  # What earlier writes killed part-way left beside it (the newest write is now in place).
  for left in glob.glob(os.path.join(parent, f".{glob.escape(base)}.partial-*")):
    shutil.rmtree(left, ignore_errors=True)
  for left in glob.glob(os.path.join(parent, f".{glob.escape(base)}.replaced-*")):
    shutil.rmtree(left, ignore_errors=True)
