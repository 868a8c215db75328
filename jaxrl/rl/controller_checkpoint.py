"""What a controller's checkpoints hold and how it comes back from one: the learner's weights,
optimizer state and KL reference, the loader's position, and the controller's own state (step,
version, every released and untrained group with its tokens so far). `Controller` inherits it;
it reads and sets the controller's attributes (`checkpointer`, `learner`, `loader`, `groups`,
`prompts`, `pending`, ...), documented there."""

from __future__ import annotations

import collections
import dataclasses
import logging

from jaxrl.rl.groups import Group, request_id

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ControllerState:
  """Host-side state saved with every checkpoint."""

  step: int = 0
  version: int = 0


class CheckpointedController:
  """`Controller`'s checkpoint methods."""

  def save(self) -> None:
    if self.checkpointer is not None:
      self.checkpointer.save(
        self.state.step,
        params=self.learner.params,
        opt_state=self.learner.opt_state,
        loader_state=self.loader.get_state(),
        controller_state=self.controller_state(),
        reference=self.learner.ref_params if self._kl else None,
      )

  def restore(self, step: int) -> None:
    reference = self.learner.ref_params if self._kl else None
    restored = self.checkpointer.restore(
      step, params=self.learner.params, opt_state=self.learner.opt_state, reference=reference
    )
    self.learner.params = restored["params"]
    self.learner.opt_state = restored["opt_state"]
    if "reference" in restored:
      self.learner.ref_params = restored["reference"]
    elif self._kl:
      log.warning(
        "Checkpoint %d holds no KL reference (written before references were saved): the KL "
        "term's reference is the weights the learner was built with, not those RL started "
        "from.",
        step,
      )
    self.loader.set_state(restored["loader"])
    self.load_controller_state(dict(restored["controller"]))
    self.writer.truncate_after(step)  # the steps after it run, and are written, again

  def controller_state(self) -> dict:
    """The step and version, plus every released, untrained group with its tokens so far
    (JSON-serialisable)."""
    return dataclasses.asdict(self.state) | {
      "next_group": self.next_group,
      "prompts": list(self.prompts),
      "replacements": self.replacements,
      "dropped_this_step": self.dropped_this_step,
      "groups": [g.to_dict() for g in self.groups.values()],
      "ready": list(self.ready),
      "lengths": self.lengths.state(),
      "group_size": self.cfg.rollout.group_size,  # the released groups' size
    }

  def load_controller_state(self, state: dict) -> None:
    groups = Group.load_all(state, self.cfg.rollout.group_size)
    self.next_group = state.pop("next_group", 0)
    self.prompts = collections.deque(state.pop("prompts", []))
    self.replacements = state.pop("replacements", 0)
    self.dropped_this_step = state.pop("dropped_this_step", 0)
    ready = state.pop("ready", [])
    self.lengths.load(state.pop("lengths", {}))
    self.state = ControllerState(**state)
    self.groups = {g.gid: g for g in groups}
    self.assigned.clear()
    self.pending = collections.deque()
    for g in groups:
      if g.episodes is not None:  # environments rebuilt by replaying their actions
        self.pending.extend(request_id(g.gid, j) for j in self.episodes.restore(g))
      else:
        self.pending.extend(request_id(g.gid, j) for j, done in enumerate(g.done) if not done)
    self.ready = []
    for gid in ready:
      self._score(self.groups[gid], may_drop=False)  # kept once: not dropped on resume
