"""What a decode kernel costs the H100 before it runs: registers, shared memory and code size, found on a CPU.

    PYTHONPATH=. python bench/resources.py rate:0.5 uniform:64 widths:80,48/96,32 [--warps 4 --stages 3]

Besides registers and sizes, each row gives the SASS instructions in the body of every loop of the kernel (a loop
is a backward branch), first to last: for a layout of one class, the first is the steady-state step (every token
visible), the second its masked twin, the third the loop over a program's items.

Each layout (``rate:R`` = the bench's representative layer of a rate-R plan, ``uniform:W``, or ``widths:K,K,../V,V,..``
cycled over the 8 KV heads) is lowered by Pallas for CUDA (sm_90) on this machine, then compiled by the ``triton``
package's own compiler and ptxas (``pip install triton``; it is not a kvjax dependency). Device time is scarce and
every width-mixed kernel takes a minute to compile there, so questions like "which width class sets the register
count" are answered here. Triton here is not the exact build inside jaxlib, so expect the same trends and similar,
not identical, numbers (the rate-0.5 layer: 255 registers here and under Nsight Compute on the H100; uniform 64:
144 here, 168 there).

Pallas asks the GPU for its compute capability while lowering; with no GPU the lookup is replaced by sm_90.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import types

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kvjax.layout import HeadLayout  # noqa: E402
from kvjax.pallas.common import run_classes  # noqa: E402
from kvjax.pallas.decode import paged_decode  # noqa: E402
from kvjax.schedule import PACK_TILE, build_decode_schedule  # noqa: E402

HQ, HKV, D = 32, 8, 128


def layout_of(spec: str) -> HeadLayout:
    kind, _, val = spec.partition(":")
    if kind == "uniform":
        return HeadLayout(HQ, HKV, D, (int(val),) * HKV, (int(val),) * HKV)
    if kind == "rate":
        from bench.kernels import pick_layer, rank_plan

        return pick_layer(rank_plan(float(val)), float(val))
    if kind == "widths":
        k, v = ([int(x) for x in part.split(",")] for part in val.split("/"))
        cycle = lambda ws: tuple(ws[h % len(ws)] for h in range(HKV))
        return HeadLayout(HQ, HKV, D, cycle(k), cycle(v))
    raise SystemExit(f"unknown layout {spec!r}: use rate:R, uniform:W or widths:K,../V,..")


def triton_ir(layout: HeadLayout, batch=32, ctx=4096, page_size=32, pack_tile=PACK_TILE, **knobs) -> str:
    """The Triton IR Pallas builds for ``paged_decode`` on this layout, lowered for CUDA without a GPU."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    gpu_info = registration.gpu_info_lib
    registration.gpu_info_lib = types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability="9.0"))
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        pps = ctx // page_size
        pages = batch * pps + 1
        plan = build_decode_schedule(np.full(batch, ctx), layout, page_size, 264,
                                     pack_tile=pack_tile).schedule.layer(0)
        bf16 = jnp.bfloat16
        args = (jax.ShapeDtypeStruct((batch, layout.q_cols), bf16),
                jax.ShapeDtypeStruct((pages, page_size, layout.k_cols), bf16),
                jax.ShapeDtypeStruct((pages, page_size, layout.v_cols), bf16),
                jax.ShapeDtypeStruct((batch, pps), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32), plan)
        jax.jit(lambda *a: paged_decode(*a, layout, **knobs)).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.gpu_info_lib = gpu_info
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured[0]


def resources(ir: str, warps: int, stages: int) -> dict:
    """Registers, spills (local bytes), shared memory and static SASS instructions of the IR compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as f:
            f.write(ir)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    field = lambda name: int(re.search(rf"\b{name}:(\d+)", usage).group(1))
    body = loop_bodies(sass)
    return dict(registers=field("REG"), local_bytes=field("LOCAL"), shared_bytes=kernel.metadata.shared,
                sass_instructions=body[-1], loops=body[:-1])


def loop_bodies(sass: str) -> list[int]:
    """Instructions in the body of each loop of ``nvdisasm`` output (a branch back to an earlier label), in code
    order, then the kernel's total."""
    instructions, labels = 0, {}
    loops = []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = instructions
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            back = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
            if back and back.group(1) in labels:
                loops.append(instructions + 1 - labels[back.group(1)])
            instructions += 1
    return [n for n in loops if n > 1] + [instructions]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("layouts", nargs="+", help="rate:R, uniform:W or widths:K,K,../V,V,.. (cycled over 8 KV heads)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=INT",
                    help="a paged_decode keyword, e.g. --knob block_tokens=32 (repeatable), or pack_tile (the "
                         "schedule's)")
    args = ap.parse_args(argv)
    knobs = {k: int(v) for k, v in (kv.split("=") for kv in args.knob)}
    print(f"paged_decode, sm_90, {args.warps} warps, {args.stages} stages, knobs {knobs or 'default'}\n")
    print("| layout | classes | registers | spilled bytes | shared bytes | SASS instructions | loop bodies |\n"
          "|---|---|---|---|---|---|---|")
    for spec in args.layouts:
        layout = layout_of(spec)
        ir = triton_ir(layout, num_warps=args.warps, num_stages=args.stages, **knobs)
        r = resources(ir, args.warps, args.stages)
        classes = len(run_classes(layout, knobs.get("pack_tile", PACK_TILE))[0])
        print(f"| {spec} | {classes} | {r['registers']} | {r['local_bytes']} | "
              f"{r['shared_bytes']} | {r['sass_instructions']} | {' '.join(map(str, r['loops']))} |", flush=True)


if __name__ == "__main__":
    main()
