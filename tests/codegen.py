"""The XLA:CPU code generation the suite compiles its programs with: set by tests/conftest.py
before JAX starts, inherited by every process the tests start, and dropped again where a run
is documented as a user's command computes it (tests/tiny_runs.py's default_codegen_env).

Compiling is most of the suite's time, and its programs are tiny, so the suite trades the
generated code's speed for compile time. Both settings change how XLA emits code, not what it
computes: XLA's own passes are the same, and results agree to float32 rounding. Measured on the
tiny fsdp x tensor model's 12 steps against XLA's defaults: the losses to the bit, every
parameter within 1.2e-7 (within 6e-8 with LLVM's setting alone). The TPU compiles read
LIBTPU_INIT_ARGS, not these.

- `--xla_backend_optimization_level=0`: LLVM's optimizations off. The tiny train step compiled
  in 2.2 s instead of 3.2; the generated code runs slower (the CPU demo's step ~1.8x).
- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's earlier (elemental) emitters for fused ops
  instead of its MLIR fusion emitters, which take most of the backend compile of a tiny program
  (the tiny fsdp x tensor step and its evaluation step on jaxlib 0.10.2: 2.7-3.2 s of XLA
  compile -> 0.7-1.3 s; test_step.py and test_losses.py together 131 s -> 71 s). With XLA's
  default optimizations the CPU demo's step took the same time either way. jaxlib 0.11.1
  dropped the flag (an unknown name in XLA_FLAGS ends the process), so it is set only below
  that release; 0.10.2 and 0.11.0 have it.
"""
from __future__ import annotations

import importlib.metadata
import re

OPTIMIZATION_LEVEL = "--xla_backend_optimization_level=0"
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_LAST_WITH_FUSION_EMITTERS_FLAG = (0, 11, 0)


def _release(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def flags(jaxlib_version: str | None = None) -> tuple[str, ...]:
  """The suite's code generation flags for this jaxlib (the installed one by default)."""
  version = jaxlib_version or importlib.metadata.version("jaxlib")
  if _release(version) <= _LAST_WITH_FUSION_EMITTERS_FLAG:
    return OPTIMIZATION_LEVEL, FUSION_EMITTERS
  return (OPTIMIZATION_LEVEL,)


def without(xla_flags: str) -> list[str]:
  """`xla_flags` (an XLA_FLAGS value) without the suite's code generation flags: XLA's
  defaults, as a user's command has them."""
  names = {flag.split("=")[0] for flag in (OPTIMIZATION_LEVEL, FUSION_EMITTERS)}
  return [f for f in xla_flags.split() if f.split("=")[0] not in names]
