"""Kernels lowered for a platform this machine does not have: export for CUDA with the Pallas
Triton call allowed, and the Triton IR inside each such call, parsed and verified."""

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"


def export_cuda(f, *args) -> jax.export.Exported:
  """`jax.jit(f)` exported for CUDA. The Triton custom call carries IR with no cross-version
  guarantee, so export refuses it unless told; what the tests want is the lowering itself, not
  a serialised artifact."""
  return jax.export.export(
    jax.jit(f),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
  )(*args)


def triton_modules(stablehlo_text: str) -> list[tuple[bool, str]]:
  """(verified, text) of the Triton IR embedded in each Pallas GPU custom call."""
  from jax._src.interpreters import mlir
  from jax._src.lib import triton
  from jax._src.lib.mlir import ir

  ctx = mlir.make_ir_context()
  triton.dialect.register_dialect(ctx)
  ctx.load_all_available_dialects()
  found = []
  with ctx:
    module = ir.Module.parse(stablehlo_text)

    def visit(op):
      if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        found.append(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
      return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return [(m.operation.verify(), str(m)) for m in found]
