"""The learner hands its `KernelMesh` to the attention kernels (`jaxrl.kernels.partitioning`).

On CPU the flash kernel's "auto" runs the reference, which is not split, so the kernels'
own tests (tests/kernels/partitioning_test.py) check the split; this one checks that the mesh
reaches them through the model.
"""

import jax
import numpy as np

from jaxrl.kernels import KernelMesh
from jaxrl.model import Model, cache, get_preset
from jaxrl.sharding import TRAIN_RULES, make_mesh
from jaxrl.train import Learner, LossConfig, OptimizerConfig


def test_the_learner_passes_its_kernel_mesh_to_flash_attention(monkeypatch):
  seen = []
  flash = cache.flash_attention

  def recording(*args, **kwargs):
    seen.append(kwargs.get("mesh"))
    return flash(*args, **kwargs)

  monkeypatch.setattr(cache, "flash_attention", recording)
  model = Model(get_preset("tiny", max_seq_len=16, attention="flash"))
  mesh = make_mesh(jax.devices()[4:6], {"fsdp": 2})
  learner = Learner(
    model, mesh, TRAIN_RULES, loss=LossConfig(), optimizer=OptimizerConfig(),
    updates_per_step=1, micro_batch_size=2,
    temperature=1.0, params=model.init(0),
  )  # fmt: skip
  assert learner.kernel_mesh == KernelMesh(mesh, rows=("fsdp",), heads=())
  tokens = np.random.default_rng(0).integers(3, 60, (2, 12)).astype(np.int32)
  learner.logprobs(learner.params, tokens)
  assert seen and all(m == learner.kernel_mesh for m in seen)
