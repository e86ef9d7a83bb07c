"""The CuTe DSL kernels of moonep_ops, their JIT layer and host-side contracts.

Importing this package imports no CuTe DSL; each kernel module imports it on first use. One thing is
set up here, before any of them can: the DSL's JAX bridge is kept from importing JAX.

Why: ``import cutlass`` imports ``cutlass.jax``, whose ``is_available()`` imports JAX whenever JAX is
installed — 0.9 s of a 3.6 s warm start on the H200 machine (benchmarks/results/bench_cold_start.json),
for a bridge these kernels never use (they take torch tensors through tvm-ffi). ``_DslWithoutJax``
answers that one import — the first ``import jax`` after ``cutlass.jax`` starts loading — with
ModuleNotFoundError, which the bridge catches and reports as "JAX not available"; then it removes
itself. Any later ``import jax`` (the user's) imports JAX as usual. A process that imported JAX or the
DSL before this package keeps the bridge as the DSL sets it up (nothing is installed then).
"""

from __future__ import annotations

import sys


class _DslWithoutJax:
    """A meta-path finder that fails the import of ``jax`` made by ``cutlass.jax``, once."""

    def __init__(self):
        self.bridge_loading = False

    def find_spec(self, name, path=None, target=None):
        if name == "cutlass.jax":
            self.bridge_loading = True
        elif name == "jax" and self.bridge_loading:
            sys.meta_path.remove(self)
            raise ModuleNotFoundError("moonep_ops: the CuTe DSL's JAX bridge is not loaded (csrc_cute/__init__.py)",
                                      name="jax")
        return None  # every other import goes to the usual finders

    def invalidate_caches(self):
        pass


if "cutlass" not in sys.modules and "jax" not in sys.modules:
    sys.meta_path.insert(0, _DslWithoutJax())
