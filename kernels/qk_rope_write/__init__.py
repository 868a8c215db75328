"""The step between a decode step's q/k/v projections and its paged attention, in one kernel on
GPU: per-head RMS norms of q and k, their rotary embedding, and the write of k and v into the
pages. Pure-jnp reference (the definition, the CPU and TPU path) and a Pallas GPU kernel."""

from jaxrl.kernels.qk_rope_write.api import qk_rope_write
from jaxrl.kernels.qk_rope_write.reference import apply_rope, rms_norm, write_rows

__all__ = ["apply_rope", "qk_rope_write", "rms_norm", "write_rows"]
