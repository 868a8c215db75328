"""Fixtures most rollout tests share: their mesh and the tiny model's weights. A test module
that needs another mesh (or model) defines its own fixture of the same name."""

import jax
import numpy as np
import pytest
from helpers.paged_engines import MODEL

from jaxrl.sharding import make_mesh


@pytest.fixture(scope="module")
def mesh():
  """data 2 x tensor 2: requests split over two devices' KV pools, heads and vocabulary over
  two."""
  return make_mesh(jax.devices()[:4], {"data": 2, "tensor": 2})


@pytest.fixture(scope="module")
def params():
  """`helpers.paged_engines.MODEL`'s weights, from a seed drawn for each module."""
  return MODEL.init(np.random.randint(1 << 16))
