"""Writes `tests/module_seconds.json` (each test module's seconds in a full run, which
`tests/conftest.py` orders the suite's modules by) from the output of a run with durations:

    python -m pytest -q --durations=0 | tee run.txt
    python tests/helpers/module_seconds.py run.txt

The figures only order the modules (longest first, so that a run ends on short ones): stale
ones cost time, never a test. A module missing from the file runs first.
"""

import collections
import json
import os
import re
import sys

_LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?\.py)::")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(TESTS, "module_seconds.json")


def module_seconds(lines) -> dict[str, float]:
  seconds = collections.Counter()
  for line in lines:
    match = _LINE.match(line)
    if match:
      seconds[match.group(2)] += float(match.group(1))
  return {module: round(s, 1) for module, s in sorted(seconds.items())}


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  with open(sys.argv[1]) as f:
    seconds = module_seconds(f)
  if not seconds:
    sys.exit(f"No durations in {sys.argv[1]}: run pytest with --durations=0.")
  with open(OUT, "w") as f:
    json.dump(seconds, f, indent=0)
    f.write("\n")
  print(f"{len(seconds)} modules, {sum(seconds.values()):.0f} s in all -> {OUT}")
