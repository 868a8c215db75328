"""`WeightStore`: readers on several threads pull the same version and move it at once."""

import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.rl.weights import WeightStore
from jaxrl.sharding import make_mesh


def _pull_and_move_at_once(store: WeightStore, readers: list[NamedSharding]) -> list:
  """Each reader thread pulls the newest version and moves it to its layout, all starting
  together; returns what each moved. Raises the first reader's error."""
  start, errors, moved = threading.Barrier(len(readers)), [], [None] * len(readers)

  def read(k):
    try:
      start.wait(timeout=60)
      _, pulled = store.pull(0)
      moved[k] = jax.block_until_ready(jax.device_put(pulled, [readers[k]] * len(pulled)))
    except Exception as e:  # noqa: BLE001 (raised below, on the test's thread)
      errors.append(e)

  threads = [threading.Thread(target=read, args=(k,)) for k in range(len(readers))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "a reader did not finish in 120 s"
  if errors:
    raise errors[0]
  return moved


def test_two_readers_move_one_published_version_at_once():
  """Two rollout workers pull a version the learner just made and each moves it to its own
  layout, at the same moment. jaxlib lists a fresh array's pieces on first use without a lock;
  unless the store lists them when it publishes, concurrent first reads leave arrays with more
  pieces than devices and `device_put` fails (this test failed 3 runs of 3 with the store's
  `readable_from_threads` taken out, on jax 0.10.2's CPU client; CI met it in the async job)."""
  devices = jax.devices()
  learner = NamedSharding(make_mesh(devices[4:8], {"fsdp": 4}), P("fsdp", None))
  readers = [
    NamedSharding(make_mesh(devices[0:2], {"tensor": 2}), P(None, "tensor")),
    NamedSharding(make_mesh(devices[2:4], {"tensor": 2}), P(None, "tensor")),
  ]
  make = jax.jit(lambda i: jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) + i)
  switch = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # threads switch often: their first reads overlap
  try:
    for version in range(1, 6):
      store = WeightStore()
      params = [jax.device_put(make(i), learner) for i in range(200)]
      store.publish(params, version)
      moved = _pull_and_move_at_once(store, readers)
      assert all(len(x.addressable_shards) == 4 for x in params), f"version {version}"
      for reader, arrays in zip(readers, moved, strict=True):
        for x, published in zip(arrays, params, strict=True):
          assert x.sharding == reader
          np.testing.assert_array_equal(np.asarray(x), np.asarray(published))
  finally:
    sys.setswitchinterval(switch)
