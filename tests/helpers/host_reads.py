"""Which device arrays a block of code reads whole onto the host."""

import contextlib

from jax._src import array as jax_array


@contextlib.contextmanager
def whole_arrays_read_on_the_host(monkeypatch):
  """Records the shapes of device arrays read whole onto the host inside the block (what
  `device_put` does to move an array between layouts whose pieces differ, and `np.asarray`)."""
  seen, value = [], jax_array.ArrayImpl._value

  def spy(self):
    seen.append(self.shape)
    return value.fget(self)

  with monkeypatch.context() as patch:
    patch.setattr(jax_array.ArrayImpl, "_value", property(spy))
    yield seen
