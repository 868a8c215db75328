"""`cache.write_pages`, the paged cache's write of new keys and values (one scatter of whole
rows, the form that XLA compiles for TPU without copying the pool): against a plain loop, with
tokens in one page, padding tokens dropped, and the pool's dtype kept."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model.cache import write_pages


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_token_lands_at_its_page_and_slot_and_nothing_else_changes(dtype):
  rng = np.random.default_rng(0)
  k, p, z, e, b, t = 2, 5, 8, 16, 3, 4
  pool = rng.standard_normal((k, p, z, e)).astype(np.float32)
  new = rng.standard_normal((b, t, k, e)).astype(np.float32)
  flat = rng.choice(p * z, b * t, replace=False).reshape(b, t)
  flat[0, :] = [z + 1, z + 2, z + 5, z + 7]  # a row's tokens in one page
  page, slot = flat // z, flat % z
  page[1, 3], page[2, 0] = p, -1  # padding: out of range, nothing written
  out = write_pages(jnp.asarray(pool, dtype), jnp.asarray(new, dtype), page, slot)
  assert out.dtype == dtype and out.shape == pool.shape
  expected = np.array(jnp.asarray(pool, dtype), np.float32)
  cast = np.asarray(jnp.asarray(new, dtype), np.float32)
  for i in range(b):
    for j in range(t):
      if 0 <= page[i, j] < p:
        expected[:, page[i, j], slot[i, j]] = cast[i, j]
  np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
