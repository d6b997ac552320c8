"""XLA's compile time for modules that call the decode kernel, with JAX's persistent cache off: whether a module
pays once per call site or once per distinct kernel, and whether a kernel compiled earlier in the process is
reused by another module. Table: bench/results/kernels.md "Decode: compile time"."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.decode import schedule_of
from bench.harness import PagedCase, rank_plan
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.kernel import paged_decode


def compile_times(key, match="", config: DecodeConfig = DECODE) -> list[dict]:
    """Rows of compile seconds for modules of 1 to 32 rate-0.5 layers (the rows whose name contains ``match``)."""
    jax.config.update("jax_enable_compilation_cache", False)
    plan05 = rank_plan(0.5, config=config)
    layers = sorted(plan05, key=lambda lay: abs(lay.k_cols + lay.v_cols - 1024))  # distinct layers of the plan

    def module(layouts, calls_each=1):
        """A jitted function calling the kernel ``calls_each`` times on each layout (each call its own q)."""
        cases = [PagedCase(lay, 32, np.full(32, 4096), 32, 1, key) for lay in layouts]
        scheds = [schedule_of(c, config).schedule.layer(0) for c in cases]

        def fn(qs, pages):  # the pages are arguments, as in the engine (closed over, they become constants)
            outs = []
            for c, sch, q, (k, v, table) in zip(cases, scheds, qs, pages, strict=True):
                outs += [
                    paged_decode(q * (i + 1), k, v, table, jnp.asarray(c.lengths), sch, c.layout)
                    for i in range(calls_each)
                ]
            return outs

        return jax.jit(fn), ([c.q for c in cases], [(c.k, c.v, c.tables[0]) for c in cases])

    print("\n| module | kernel call sites | distinct kernels | compile s |\n|---|---|---|---|")
    rows = []
    for name, layouts, each in (
        ("a rate-0.5 layer, 1 call (fresh)", [layers[0]], 1),
        ("the same layer, 8 calls (compiled above, in another module)", [layers[0]], 8),
        ("4 other rate-0.5 layers, 1 call each (fresh)", layers[1:5], 1),
        ("all 32 layers of the rate-0.5 plan, 1 call each: a decode step (fresh)", layers, 1),
    ):
        if match not in name:
            continue
        fn, args = module(layouts, each)
        t0 = time.perf_counter()
        fn.lower(*args).compile()
        t = time.perf_counter() - t0
        rows.append(dict(module=name, sites=len(layouts) * each, kernels=len(layouts), seconds=t))
        print(f"| {name} | {len(layouts) * each} | {len(layouts)} | {t:.1f} |", flush=True)
    jax.config.update("jax_enable_compilation_cache", True)
    return rows
