"""``jit_once``: jit for functions compression runs a few times each (per layer, per calibration batch).

On a GPU XLA may emit a GEMM as a Triton kernel and autotune its tiles while it compiles, seconds a shape, which
pays off only over many calls; these functions run a few times, so their GEMMs go to cuBLAS, whose algorithm
choice is quick (bench/results/startup.md "Start-up: compression").
"""

from __future__ import annotations

import functools

import jax

COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def jit_once(fun=None, **kwargs):
    """``jax.jit`` (same arguments) with GEMMs on cuBLAS; usable bare or with arguments."""
    if fun is None:
        return functools.partial(jit_once, **kwargs)
    return jax.jit(fun, compiler_options=COMPILER_OPTIONS, **kwargs)
