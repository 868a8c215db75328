"""Parameter grids whose whole product runs with `-m slow`; a default run takes a covering part.

For a grid whose axes exercise separate code (a model variant, and the mesh it runs on), each
combination mostly repeats what others check, and every one compiles its own programs: the
default suite runs the combinations that give every value of every axis once, and `-m slow`
the rest.
"""

import itertools

import pytest


def covering(*axes: dict):
  """pytest params (one argument per axis, ids "<id>-<id>") over the product of `axes`, each a
  dict of id -> value: combination k of each axis' k-th value (modulo its length, for k up to
  the longest axis' length) runs by default, so that every value of every axis runs once; the
  rest of the product is marked `slow`."""
  if not axes or any(not axis for axis in axes):
    raise ValueError("covering() needs at least one axis, and every axis at least one value.")
  items = [list(axis.items()) for axis in axes]
  longest = max(len(axis) for axis in items)
  default = {tuple(k % len(axis) for axis in items) for k in range(longest)}
  params = []
  for index in itertools.product(*(range(len(axis)) for axis in items)):
    chosen = [axis[i] for axis, i in zip(items, index, strict=True)]
    params.append(
      pytest.param(
        *(value for _, value in chosen),
        id="-".join(str(key) for key, _ in chosen),
        marks=() if index in default else pytest.mark.slow,
      )
    )
  return params
