"""Runs untrusted Python (the model's code) in a subprocess with limits.

`run_python(code, limits, workdir)` writes the code into `workdir` (a fresh temporary directory
when None), runs it there with a new interpreter and returns a `SandboxResult`: stdout and
stderr interleaved as a terminal shows them, truncated to `max_output_chars` (head and tail
kept), and a status: "ok", "error" (non-zero exit: the traceback is in the output), "timeout"
(wall clock), "cpu_limit" or "memory_limit".

Every run gets, through `resource.setrlimit` in the child before it executes anything: CPU time
(`RLIMIT_CPU`: SIGXCPU at the limit, SIGKILL a second later), address space (`RLIMIT_AS`: an
allocation past it raises MemoryError), file size (`RLIMIT_FSIZE`) and no core files; a new
session, killed as a whole at the wall-clock limit; an environment of a few fixed variables
(no inherited secrets); stdin closed.

Isolation, where Linux namespaces can be made (as root, or with unprivileged user namespaces):
the code runs under `unshare` in new network, mount and PID namespaces. No network interface
but a loopback that is down, so nothing can be reached, not even the host's localhost; every
mount read-only except `workdir` and fresh size-limited tmpfs over /tmp, /var/tmp, /dev/shm and
/run/lock, so nothing can be written outside `workdir` (and scratch space that vanishes);
every capability dropped (`setpriv`, no new privileges), so none of that can be undone; and
the whole process tree dies with the run. `isolation()` says what this machine gives.

Limits (why this is "best effort"): without namespaces the code can use the network and write
wherever the user running the trainer can, and its child processes can outlive it if they leave
its session. With them, it can still read every file that user can read, and there is no cap on
the number of processes (a fork bomb runs until the wall-clock limit). `RLIMIT_AS` counts
address space, not resident memory, and applies per process. This is a guard against buggy and
careless code, not a security boundary against a determined attacker: for that, run the
environment workers in a container or VM (gVisor, Firecracker) of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

CODE_FILE = ".snippet.py"
# Writable in-namespace scratch mounts (each a fresh tmpfs), if the directory exists.
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_STORE_BYTES = 1 << 20  # output kept whole up to this; past it only the head and a tail
_TAIL_LINES = 3  # lines of the output's end searched for a MemoryError

# Runs as PID 1 of the new namespaces, as root there: $1 workdir, $2 tmpfs size, $3 verbose,
# then the command. Mounts scratch tmpfs, binds the workdir at its own path (its parent may be
# under a scratch dir; --no-canonicalize keeps "." the directory we are in, not the path), makes
# every other mount read-only, then runs the command with every capability dropped. Not `exec`:
# PID 1 ignores signals it has no handler for, and the code must die of SIGXCPU.
_NAMESPACE_SCRIPT = f"""
set -eu
wd=$1; size=$2; verbose=$3; shift 3
for d in {" ".join(_SCRATCH_DIRS)}; do
  if [ -d "$d" ]; then mount -t tmpfs -o "size=$size,mode=1777,nosuid,nodev" tmpfs "$d"; fi
done
mkdir -p "$wd"
mount --no-canonicalize --bind . "$wd"
cd "$wd"
while read -r _ m _; do
  case "$m" in
    {"|".join(f"{d}|{d}/*" for d in _SCRATCH_DIRS)}|"$wd"|*\\\\*) ;;
    *) mount -o remount,bind,ro "$m" 2>/dev/null || [ "$verbose" = 0 ] || echo "writable $m" ;;
  esac
done < /proc/self/mounts
set +e
setpriv --inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"
exit $?
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one run.

  Attributes:
    timeout_s: wall-clock seconds before the run is killed.
    cpu_s: CPU seconds (whole seconds, rounded up) before the kernel stops it.
    memory_mb: address space of each process, in MiB.
    file_mb: the largest file it may write, and the size of each scratch tmpfs, in MiB.
    max_output_chars: characters of output kept (the first and last halves).
  """

  timeout_s: float = 10.0
  cpu_s: float = 5.0
  memory_mb: int = 512
  file_mb: int = 16
  max_output_chars: int = 2000

  def __post_init__(self):
    for name in ("timeout_s", "cpu_s", "memory_mb", "file_mb", "max_output_chars"):
      if not getattr(self, name) > 0:
        raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """The outcome of a run.

  Attributes:
    output: stdout and stderr interleaved, truncated to the limit (a marker says how much was
      cut from the middle).
    status: "ok", "error", "timeout", "cpu_limit" or "memory_limit".
    exit_code: the code's exit status, -N for signal N, None when it was killed at the timeout
      (under namespaces a shell runs the code, and an exit status of 128 + N reads as -N).
    truncated: output was cut.
    elapsed_s: wall-clock seconds.
  """

  output: str
  status: str
  exit_code: int | None
  truncated: bool
  elapsed_s: float

  def text(self, limits: SandboxLimits) -> str:
    """What the model reads: the output, and a line saying why the run was stopped."""
    notes = {
      "timeout": f"[stopped: it ran past the {limits.timeout_s:g} s time limit]",
      "cpu_limit": f"[stopped: it used up its {math.ceil(limits.cpu_s)} s of CPU time]",
      "memory_limit": f"[stopped: it ran out of memory (limit {limits.memory_mb} MB)]",
    }
    parts = [self.output.rstrip("\n")] if self.output.strip() else []
    if self.status in notes:
      parts.append(notes[self.status])
    elif self.status == "error" and not parts:
      parts.append(f"[exited with status {self.exit_code}]")
    return "\n".join(parts) if parts else "(no output)"


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What the sandbox can enforce on this machine.

  Attributes:
    namespaces: runs use network, mount and PID namespaces (no network, read-only filesystem
      outside the workdir, capabilities dropped, the process tree killed with the run).
    writable: mounts that could not be made read-only (empty where the filesystem is sealed).
    reason: why there are no namespaces, when there are none.
  """

  namespaces: bool
  writable: tuple[str, ...] = ()
  reason: str = ""


def _namespace_prefix() -> list[str] | None:
  unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
  if not (unshare and setpriv and shutil.which("mount")):
    return None
  user = [] if os.geteuid() == 0 else ["--map-root-user"]
  return [unshare, *user, "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]


@functools.cache
def isolation() -> Isolation:
  """Probes once per process whether namespaces can be made (a run of `true` inside them)."""
  prefix = _namespace_prefix()
  if prefix is None:
    return Isolation(False, reason="unshare, setpriv or mount is not installed (util-linux)")
  with tempfile.TemporaryDirectory(prefix="jaxrl-sandbox-probe-") as workdir:
    cmd = [*prefix, "sh", "-c", _NAMESPACE_SCRIPT, "sh", workdir, "1m", "1", "true"]
    try:
      proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
      return Isolation(False, reason=f"{cmd[0]} failed: {e}")
  if proc.returncode != 0:
    why = (proc.stderr or proc.stdout).strip().splitlines()
    return Isolation(False, reason=f"unshare failed ({why[-1] if why else proc.returncode})")
  writable = tuple(line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line)
  return Isolation(True, writable)


def _set_limits(cpu_s: int, memory_bytes: int, file_bytes: int) -> None:
  # Runs in the child between fork and exec (the parent may have threads): keep it to these
  # calls, no imports, no logging.
  resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
  resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
  resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(
  code: str,
  limits: SandboxLimits,
  workdir: str | os.PathLike | None = None,
  *,
  python: str = sys.executable,
) -> SandboxResult:
  """Runs `code` as a script in `workdir` under `limits` (see the module docstring).

  Args:
    code: Python source.
    limits: time, memory, file and output limits.
    workdir: an existing directory to run in (files persist there between runs); None for a
      fresh temporary directory, removed afterwards.
    python: the interpreter (the trainer's own by default, so its packages are importable).
  """
  if workdir is None:
    with tempfile.TemporaryDirectory(prefix="jaxrl-sandbox-") as tmp:
      return run_python(code, limits, tmp, python=python)
  workdir = os.path.abspath(workdir)
  with open(os.path.join(workdir, CODE_FILE), "w", encoding="utf-8") as f:
    f.write(code)
  # -E: ignore PYTHON* variables; -s: no user site-packages; -u: unbuffered, so that stdout and
  # stderr interleave as they were written. Not -I: the workdir stays on sys.path, so the code
  # can import modules it wrote there.
  command = [python, "-E", "-s", "-u", CODE_FILE]
  namespaced = isolation().namespaces
  if namespaced:
    tmpfs = f"{limits.file_mb}m"
    command = [
      *_namespace_prefix(),
      "sh",
      "-c",
      _NAMESPACE_SCRIPT,
      "sh",
      workdir,
      tmpfs,
      "0",
      *command,
    ]
  env = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": workdir,
    "TMPDIR": workdir,
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
  }
  start = time.monotonic()
  proc = subprocess.Popen(
    command,
    cwd=workdir,
    env=env,
    stdin=subprocess.DEVNULL,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    start_new_session=True,
    preexec_fn=functools.partial(
      _set_limits, math.ceil(limits.cpu_s), limits.memory_mb << 20, limits.file_mb << 20
    ),
  )
  try:
    head, tail, total, timed_out = _read(proc, start + limits.timeout_s, limits.max_output_chars)
  finally:
    # The session's stragglers (background children) die too. The leader is not reaped yet, so
    # its group id cannot have been reused by an unrelated process.
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, signal.SIGKILL)
    cpu_s = _reap(proc)
    proc.stdout.close()
  elapsed = time.monotonic() - start
  exit_code = None if timed_out else _exit_code(proc.returncode, namespaced)
  if namespaced and exit_code is not None and exit_code < 0:
    head, tail = _drop_shell_report(head, tail, -exit_code)
  output, truncated = _truncate(head, tail, total, limits.max_output_chars)
  # A kill counts as the CPU limit only if the CPU time was used up: under namespaces the
  # shell reports `sys.exit(137)` as it would SIGKILL, and the OOM killer sends SIGKILL too.
  used_up = cpu_s is None or cpu_s >= 0.9 * math.ceil(limits.cpu_s)
  status = _status(exit_code, output, timed_out, used_up)
  return SandboxResult(output, status, exit_code, truncated, elapsed)


def _reap(proc: subprocess.Popen) -> float | None:
  """Waits for `proc` and sets its returncode; returns the CPU seconds it and the descendants
  it waited for used (None if something else reaped it)."""
  try:
    _, status, usage = os.wait4(proc.pid, 0)
  except ChildProcessError:
    proc.wait()
    return None
  proc.returncode = os.waitstatus_to_exitcode(status)
  return usage.ru_utime + usage.ru_stime


def _read(
  proc: subprocess.Popen, deadline: float, max_chars: int
) -> tuple[bytes, bytes, int, bool]:
  """Reads the output until EOF and exit, or the deadline. Returns (head, tail, total bytes,
  timed out): head is the first _STORE_BYTES, tail the last bytes past them."""
  fd = proc.stdout.fileno()
  head, tail = bytearray(), bytearray()
  tail_cap = 4 * max_chars + 4096
  total = 0
  with selectors.DefaultSelector() as selector:
    selector.register(fd, selectors.EVENT_READ)
    while True:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return bytes(head), bytes(tail), total, True
      if not selector.select(remaining):
        continue
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        break
      total += len(chunk)
      room = _STORE_BYTES - len(head)
      head += chunk[:room]
      if len(chunk) > room:
        tail += chunk[max(room, 0) :]
        del tail[:-tail_cap]
  # EOF: wait for the exit without reaping (the group must stay ours until it is killed).
  while True:
    try:
      if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
        return bytes(head), bytes(tail), total, False
    except ChildProcessError:  # already reaped: nothing left to wait for
      return bytes(head), bytes(tail), total, False
    if time.monotonic() >= deadline:
      return bytes(head), bytes(tail), total, True
    time.sleep(0.005)


def _truncate(head: bytes, tail: bytes, total: int, max_chars: int) -> tuple[str, bool]:
  if not tail:
    text = head.decode("utf-8", errors="replace")
    if len(text) <= max_chars:
      return text, False
    cut = len(text) - max_chars
    first, last = text[: max_chars // 2], text[len(text) - (max_chars - max_chars // 2) :]
    return f"{first}\n[... {cut} characters cut ...]\n{last}", True
  first = head.decode("utf-8", errors="replace")[: max_chars // 2]
  last = tail.decode("utf-8", errors="replace")[-(max_chars - max_chars // 2) :]
  return f"{first}\n[... about {total - _STORE_BYTES} bytes cut ...]\n{last}", True


def _drop_shell_report(head: bytes, tail: bytes, signum: int) -> tuple[bytes, bytes]:
  """Removes the line the namespace's shell writes when the code dies of a signal (e.g. "CPU time
  limit exceeded"): it is not the code's output, and runs without namespaces do not have it."""
  report = f"{signal.strsignal(signum)}\n".encode()
  if tail.endswith(report):
    return head, tail[: -len(report)]
  if not tail and head.endswith(report):
    return head[: -len(report)], tail
  return head, tail


def _exit_code(returncode: int, namespaced: bool) -> int:
  # Under namespaces the code is a child of a shell, which reports death by signal N as 128 + N
  # (and unshare passes a signal of its own on as one).
  if namespaced and 128 < returncode < 128 + signal.NSIG:
    return -(returncode - 128)
  return returncode


def _status(exit_code: int | None, output: str, timed_out: bool, cpu_used_up: bool) -> str:
  if timed_out:
    return "timeout"
  if exit_code == 0:
    return "ok"
  if cpu_used_up and exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL: the hard limit
    return "cpu_limit"
  end = output.rstrip().splitlines()[-_TAIL_LINES:]
  if any("MemoryError" in line or "Cannot allocate memory" in line for line in end):
    return "memory_limit"
  return "error"
