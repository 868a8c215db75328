"""The paged engine the rollout tests build: the tiny preset (fp32), its end and padding ids,
and an engine with weights set."""

from jaxrl.model import Model, get_preset
from jaxrl.rollout.paged import PagedConfig, PagedEngine
from jaxrl.sharding import ROLLOUT_RULES

EOS, PAD = 2, 0
MODEL = Model(get_preset("tiny"))


def engine(mesh, params, version=0, *, model: Model = MODEL, **cfg) -> PagedEngine:
  """A paged engine of `model` on `mesh` (`cfg`: `PagedConfig`'s fields) holding `params` as
  `version`."""
  e = PagedEngine(model, mesh, ROLLOUT_RULES, eos_id=EOS, pad_id=PAD, config=PagedConfig(**cfg))
  e.update_weights(params, version)
  return e
