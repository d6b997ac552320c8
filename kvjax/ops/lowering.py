"""The Triton IR of a function's Pallas kernels, lowered for CUDA sm_90 on a machine without a GPU: what XLA would
compile, for tests (layers share one compiled kernel) and for offline resource counts (``bench/resources.py``)."""

from __future__ import annotations

import contextlib
import types

import jax


@contextlib.contextmanager
def as_if_on_gpu(capability: int = 90):
    """Pallas asks the GPU for its compute capability while lowering a Triton kernel; meanwhile the lookup answers
    ``capability`` (an integer, as Pallas reads it: 90 for sm_90), so a process without that GPU lowers its
    kernels (the step store's tracing processes, ``runtime.step_cache``)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    gpu_info = registration.gpu_info_lib
    registration.gpu_info_lib = types.SimpleNamespace(  # type: ignore[assignment]  # a stand-in for the module
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability=capability)
    )
    try:
        yield
    finally:
        registration.gpu_info_lib = gpu_info


def triton_modules(fn, args) -> list[str]:
    """The Triton IR of every Pallas kernel call in ``fn(*args)``, in call order."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kwargs):
        result = lower(*a, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        with as_if_on_gpu():
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured
