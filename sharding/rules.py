"""Logical-axis rules: from the logical axes of parameters and activations to mesh axes.

A parameter is annotated with one logical name (or None) per dimension, e.g. an MLP input
kernel with `("embed", "mlp")`. A stage's rule table maps each logical name to mesh axes, so one
annotation gives the training layout (`TRAIN_RULES`, with fsdp) and the rollout layout
(`ROLLOUT_RULES`, without fsdp).

Rule tables are short on purpose: every logical name has exactly one rule, a rule the model does
not use is an error (`check_rules`), and a name without a rule is an error too.
"""

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.kernels.partitioning import KernelMesh
from jaxrl.sharding.mesh import MESH_AXES

MeshAxes = str | tuple[str, ...] | None
"""What a logical axis maps to: one mesh axis, several (sharded over their product), or None."""

Rules = tuple[tuple[str, MeshAxes], ...]
"""A rule table: `(logical_name, mesh_axes)` pairs, one per logical name."""

LOGICAL_AXES = (
  "vocab",
  "embed",
  "mlp",
  "heads",
  "kv_heads",
  "head_dim",
  "expert",
  "norm",
  "batch",
  "length",
)
"""Every logical axis name the model uses: parameters, then activations."""

TRAIN_RULES: Rules = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("expert", "expert"),
  ("norm", None),
)

ROLLOUT_RULES: Rules = (
  ("batch", "data"),
  ("length", None),
  ("vocab", "tensor"),
  ("embed", None),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("expert", "expert"),
  ("norm", None),
)

STAGE_RULES: dict[str, Rules] = {"train": TRAIN_RULES, "rollout": ROLLOUT_RULES}


def _rule_mesh_axes(rule: tuple[str, Any]) -> tuple[str, ...]:
  target = rule[1]
  if target is None:
    return ()
  if isinstance(target, str):
    return (target,)
  if isinstance(target, tuple | list) and all(isinstance(axis, str) for axis in target):
    if len(set(target)) != len(target):
      raise ValueError(f"Rule {rule!r} names a mesh axis more than once; name each once.")
    return tuple(target)
  raise ValueError(
    f"Rule {rule!r} must map to a mesh axis name, a tuple of mesh axis names, or None."
  )


def _rule_table(rules: Rules) -> dict[str, tuple[str, ...]]:
  """Checks the form of `rules` and returns logical name -> mesh axes (possibly empty)."""
  table: dict[str, tuple[str, ...]] = {}
  first: dict[str, tuple[str, Any]] = {}
  for rule in rules:
    if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ValueError(f"Rule {rule!r} must be a (logical_name, mesh_axes) pair.")
    rule = tuple(rule)
    name = rule[0]
    if name in table:
      raise ValueError(
        f"Conflicting rules for logical axis {name!r}: {first[name]!r} and {rule!r}; keep one."
      )
    table[name] = _rule_mesh_axes(rule)
    first[name] = rule
  return table


def check_rules(
  rules: Rules, used_names: Iterable[str], mesh_axes: Sequence[str] = MESH_AXES
) -> None:
  """Checks a rule table against the logical names a model uses.

  Args:
    rules: the rule table.
    used_names: every logical axis name that the model's parameters and activations use.
    mesh_axes: the mesh axis names that rules may map to.

  Raises:
    ValueError: naming every offending rule: a logical name with two rules (conflict), a rule
      for a name that is not used (unused), a rule mapping to a mesh axis not in `mesh_axes`,
      or a used name without a rule.
  """
  table = _rule_table(rules)
  used = set(used_names)
  problems = []
  for name, axes in table.items():
    unknown = [axis for axis in axes if axis not in mesh_axes]
    if unknown:
      problems.append(
        f"rule {(name, axes)!r} maps to unknown mesh axis {unknown}; the mesh axes are "
        f"{tuple(mesh_axes)}"
      )
    if name not in used:
      problems.append(f"rule {(name, axes)!r} is unused: no parameter or activation has {name!r}")
  for name in sorted(used - set(table)):
    problems.append(f"logical axis {name!r} is used but has no rule; add ({name!r}, None)")
  if problems:
    raise ValueError("Bad logical-axis rules:\n  - " + "\n  - ".join(problems))


def _is_logical_axes(x: Any) -> bool:
  if isinstance(x, PartitionSpec):
    return True
  return isinstance(x, tuple) and all(entry is None or isinstance(entry, str) for entry in x)


def _suggest_sizes(dim_size: int, axes: Sequence[str], mesh: Mesh) -> str:
  remaining = dim_size
  suggestion = []
  for axis in axes:
    size = math.gcd(mesh.shape[axis], remaining)
    remaining //= size
    suggestion.append(f"{axis}={size}")
  return ", ".join(suggestion)


def logical_to_pspec(
  logical_axes: tuple[str | None, ...] | PartitionSpec,
  rules: Rules,
  mesh: Mesh,
  shape: tuple[int, ...] | None = None,
) -> PartitionSpec:
  """Maps one array's logical axes to a PartitionSpec on `mesh`.

  Mesh axes of size 1 are dropped (replication over them is the same layout). A mesh axis is
  used at most once per spec: where a dimension's rule names a mesh axis that an earlier
  dimension already uses, that dimension is replicated over it.

  Args:
    logical_axes: one logical name (or None, replicated) per dimension; `()` for a scalar.
    rules: the rule table; every name in `logical_axes` must have a rule.
    mesh: the mesh the spec is for.
    shape: the array's shape; when given, each sharded dimension must be divisible by the
      product of its mesh axis sizes.

  Returns:
    A PartitionSpec with one entry per dimension: None, a mesh axis name, or a tuple of them.

  Raises:
    ValueError: a name without a rule, a rule that maps to an axis the mesh lacks, a shape of
      a different rank, or a dimension the mesh axes do not divide.
  """
  if isinstance(logical_axes, PartitionSpec):
    logical_axes = tuple(logical_axes)
  if not _is_logical_axes(logical_axes):
    raise ValueError(
      f"Logical axes {logical_axes!r} must be a tuple of logical axis names or None, one per "
      "dimension."
    )
  table = _rule_table(rules)
  if shape is not None and len(shape) != len(logical_axes):
    raise ValueError(
      f"Logical axes {logical_axes!r} have {len(logical_axes)} entries but the shape "
      f"{tuple(shape)} has {len(shape)} dimensions; give one logical axis per dimension."
    )
  used: set[str] = set()
  entries: list[MeshAxes] = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      entries.append(None)
      continue
    if name not in table:
      raise ValueError(
        f"Logical axis {name!r} has no rule (rules cover {sorted(table)}); add ({name!r}, None) "
        "to replicate it, or map it to a mesh axis."
      )
    axes = []
    for axis in table[name]:
      if axis not in mesh.shape:
        raise ValueError(
          f"The rule for logical axis {name!r} maps to mesh axis {axis!r}, which the mesh "
          f"{dict(mesh.shape)} does not have."
        )
      if mesh.shape[axis] > 1 and axis not in used:
        axes.append(axis)
    used.update(axes)
    if shape is not None and axes:
      shards = math.prod(mesh.shape[axis] for axis in axes)
      if shape[dim] % shards:
        sizes = ", ".join(f"{axis}={mesh.shape[axis]}" for axis in axes)
        raise ValueError(
          f"Dimension {dim} (logical axis {name!r}) of shape {tuple(shape)} has size "
          f"{shape[dim]}, which is not divisible by the {shards} shards of mesh axes "
          f"{tuple(axes)} ({sizes}). Use a mesh whose {' * '.join(axes)} divides "
          f"{shape[dim]} (e.g. {_suggest_sizes(shape[dim], axes, mesh)}), or map {name!r} "
          "to None in the rules."
        )
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*entries)


def _shape_of(x: Any, where: str) -> tuple[int, ...] | None:
  if x is None:
    return None
  if hasattr(x, "shape"):
    return tuple(x.shape)
  if isinstance(x, tuple | list) and all(isinstance(d, int) for d in x):
    return tuple(x)
  raise TypeError(f"Shape at {where} is {x!r}; expected an array, a ShapeDtypeStruct or a tuple.")


def tree_shardings(
  logical_axes_tree: Any, mesh: Mesh, rules: Rules, shapes_tree: Any = None
) -> Any:
  """Maps a tree of logical axes to a tree of NamedShardings on `mesh`.

  Args:
    logical_axes_tree: a pytree whose leaves are logical axes: tuples (or PartitionSpecs) of
      logical names or None, one entry per dimension. `()` is a scalar and None an array
      without annotation; both are replicated.
    mesh: the mesh of the shardings.
    rules: the rule table.
    shapes_tree: optional tree of the same structure with arrays, `jax.ShapeDtypeStruct`s (as
      from `jax.eval_shape`) or shape tuples at the leaves, to check divisibility.

  Returns:
    A tree of the same structure with a `NamedSharding` at each leaf.

  Raises:
    ValueError: as `logical_to_pspec`, with the leaf's path; or `shapes_tree` does not match.
    TypeError: a leaf that is not a tuple of logical names.
  """
  is_leaf = lambda x: x is None or _is_logical_axes(x)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(logical_axes_tree, is_leaf=is_leaf)
  if shapes_tree is None:
    shapes = [None] * len(leaves)
  else:
    try:
      shapes = treedef.flatten_up_to(shapes_tree)
    except (ValueError, TypeError) as e:
      raise ValueError(f"shapes_tree does not have the structure of logical_axes_tree: {e}") from e
  shardings = []
  for (path, axes), shape_like in zip(leaves, shapes, strict=True):
    where = jax.tree_util.keystr(path) or "the root"
    if axes is None:
      shardings.append(NamedSharding(mesh, PartitionSpec()))
      continue
    if not _is_logical_axes(axes):
      raise TypeError(
        f"Leaf at {where} is {axes!r}; expected a tuple of logical axis names or None."
      )
    try:
      spec = logical_to_pspec(axes, rules, mesh, _shape_of(shape_like, where))
    except ValueError as e:
      raise ValueError(f"At {where}: {e}") from None
    shardings.append(NamedSharding(mesh, spec))
  return treedef.unflatten(shardings)


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
  """The sharding of a `[batch, ...]` array: dimension 0 by the `batch` rule, the rest replicated.

  Args:
    mesh: the mesh of the sharding.
    rules: the rule table; it must have a rule for `batch`.
    ndim: the array's number of dimensions, >= 1.

  Returns:
    A `NamedSharding` on `mesh`.
  """
  if ndim < 1:
    raise ValueError(f"batch_sharding needs ndim >= 1 (a batch dimension), got {ndim}.")
  return NamedSharding(mesh, logical_to_pspec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def kernel_mesh(mesh: Mesh, rules: Rules, *, split_pages: bool = False) -> KernelMesh | None:
  """Where a stage's attention kernels find their operands (`jaxrl.kernels.KernelMesh`): rows
  over the mesh axes of the `batch` rule, kv heads over those of `kv_heads` (each only where
  more than one device); None on one device (the kernels are then called as they are).
  `split_pages`: KV pools whose pages split over the rows' axes (`kv_pool_pspec`)."""
  if mesh.size == 1:
    return None
  table = _rule_table(rules)
  sizes = dict(mesh.shape)
  rows, heads = (
    tuple(a for a in table.get(name, ()) if sizes.get(a, 1) > 1) for name in ("batch", "kv_heads")
  )
  return KernelMesh(mesh, rows, heads, split_pages=split_pages and bool(rows))


def kv_pool_pspec(mesh: Mesh, rules: Rules, shape: Sequence[int]) -> PartitionSpec:
  """The spec of a paged KV pool `[kv_heads, pages, page_size, head_dim]`: heads and head dims
  by their rules, and the pages over the `batch` rule's axes, with the rows that read them
  (`KernelMesh.split_pages`): each device holds its own rows' pages, so the pool's capacity
  grows with the devices the rows split over."""
  return logical_to_pspec(("kv_heads", "batch", None, "head_dim"), rules, mesh, shape)
