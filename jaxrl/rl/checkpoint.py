"""Orbax checkpoints of a run: params, optimizer state, data-iterator and controller state."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl.config import ConfigError


class Checkpointer:
  """Saves and restores everything a run needs to continue exactly where it stopped."""

  def __init__(self, directory: str, max_to_keep: int):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    )

  def save(
    self,
    step: int,
    *,
    params,
    opt_state,
    loader_state: dict,
    controller_state: dict,
    reference=None,
  ) -> None:
    """`reference`: the KL term's reference parameters, where the loss has one (they are the
    weights RL started from, which a resumed run cannot rebuild once step 0 is pruned)."""
    items = dict(
      params=ocp.args.StandardSave(params),
      opt_state=ocp.args.StandardSave(opt_state),
      loader=ocp.args.JsonSave(loader_state),
      controller=ocp.args.JsonSave(controller_state),
    )
    if reference is not None:
      items["reference"] = ocp.args.StandardSave(reference)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def has_reference(self, step: int) -> bool:
    """Whether checkpoint `step` holds KL reference parameters (saved with `reference`)."""
    return os.path.isdir(os.path.join(self.directory, str(step), "reference"))

  def restore(self, step: int, *, params, opt_state, reference=None) -> dict[str, Any]:
    """Restores onto the shardings of `params`/`opt_state` (arrays or abstract arrays); host
    (numpy) leaves restore as host arrays (a remote learner's state, read on this host).
    `reference` (laid out like `params`): also restore the KL reference, under the key
    "reference", where the checkpoint has one (`has_reference`)."""
    abstract = lambda tree: jax.tree.map(  # noqa: E731
      lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if hasattr(x, "sharding") else x
      ),
      tree,
    )
    items = dict(
      params=ocp.args.StandardRestore(abstract(params)),
      opt_state=ocp.args.StandardRestore(abstract(opt_state)),
      loader=ocp.args.JsonRestore(),
      controller=ocp.args.JsonRestore(),
    )
    if reference is not None and self.has_reference(step):
      items["reference"] = ocp.args.StandardRestore(abstract(reference))
    try:
      return self._manager.restore(step, args=ocp.args.Composite(**items))
    except ValueError as e:  # orbax: stored shapes or tree structure unlike the run's
      detail = str(e).strip().splitlines()[0][:300]
      raise ConfigError(
        f"Checkpoint {os.path.join(self.directory, str(step))} does not fit this run's model "
        f"or optimizer: it was written with another config (a changed config.model, "
        f"config.pretrained.path or config.optimizer). Resume with the config it was written "
        f"with, or start a new run in an empty --workdir. (orbax: {detail})"
      ) from None

  def close(self) -> None:
    self._manager.close()
