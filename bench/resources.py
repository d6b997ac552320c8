"""What a decode kernel costs the H100 before it runs: registers, shared memory and code size, found on a CPU.

    PYTHONPATH=. python bench/resources.py rate:0.5 uniform:64 widths:80,48/96,32 [--warps 4 --stages 3]
    PYTHONPATH=. python bench/resources.py --kernel prefill rate:0.5 uniform:64 uniform:128 [--knob block_k=64]

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

``--kernel prefill`` does the same for ``prefill_attention`` (batch 1, T 4096, bf16, writing pages; the bench's
prefill knobs, ``--knob block_k=64`` etc. on top): the whole kernel's row, then each width class compiled alone,
whose first loop is its steady-state (unmasked) step, with instructions per score (rows x keys / threads) and its
MUFU.EX2 / HGMMA / FMNMX / FADD / FFMA / FMUL / F2FP counts.

The IR first goes through Triton's own TTIR passes (``ttir_pipeline``): jaxlib runs them, ``triton.compile`` skips
them for IR input, and without them no dot takes an accumulator (every prefill K piece cost one FADD per score, and
decode loops counted 1-2% more instructions than since).

Pallas asks the GPU for its compute capability while lowering; with no GPU the lookup is replaced by sm_90.
"""
from __future__ import annotations

import argparse
import ast
import collections
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
from kvjax.pallas.common import run_classes, width_classes  # noqa: E402
from kvjax.runs import loaded_columns  # noqa: E402
from kvjax.pallas.decode import paged_decode  # noqa: E402
from kvjax.pallas.prefill import block_rows, keys_per_step, prefill_attention  # noqa: E402
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
    pps = ctx // page_size
    pages = batch * pps + 1
    plan = build_decode_schedule(np.full(batch, ctx), layout, page_size, 264, pack_tile=pack_tile).schedule.layer(0)
    bf16 = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((batch, layout.q_cols), bf16),
            jax.ShapeDtypeStruct((pages, page_size, layout.k_cols), bf16),
            jax.ShapeDtypeStruct((pages, page_size, layout.v_cols), bf16),
            jax.ShapeDtypeStruct((batch, pps), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32), plan)
    return lowered_ir(lambda *a: paged_decode(*a, layout, **knobs), args)


def prefill_ir(layout: HeadLayout, batch=1, t=4096, page_size=32, **knobs) -> str:
    """The Triton IR of ``prefill_attention`` as the bench times it (bf16, writing the prompt's K/V pages)."""
    pps = t // page_size
    bf16 = jnp.bfloat16
    args = tuple(jax.ShapeDtypeStruct((batch, t, c), bf16) for c in (layout.q_cols, layout.k_cols, layout.v_cols))
    args += (jax.ShapeDtypeStruct((batch,), jnp.int32),
             *(jax.ShapeDtypeStruct((batch * pps + 1, page_size, c), bf16) for c in (layout.k_cols, layout.v_cols)),
             jax.ShapeDtypeStruct((batch, pps), jnp.int32))
    return lowered_ir(lambda q, k, v, *rest: prefill_attention(q, k, v, layout, *rest, **knobs), args)


def lowered_ir(fn, args) -> str:
    """The Triton IR of the (one) Pallas kernel in ``fn(*args)``, lowered for CUDA sm_90 without a GPU."""
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
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.gpu_info_lib = gpu_info
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured[0]


def resources(ir: str, warps: int, stages: int) -> dict:
    """Registers, spills (local bytes), shared memory and static SASS instructions of the IR compiled for sm_90
    after the TTIR passes jaxlib runs (``ttir_pipeline``); ``loop_ops`` counts each loop body's opcodes."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = GPUTarget("cuda", 90, 32)
    options = {"num_warps": warps, "num_stages": stages}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as f:
            f.write(ttir_pipeline(ir, target, options))
        kernel = triton.compile(src, target=target, options=options)
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    field = lambda name: int(re.search(rf"\b{name}:(\d+)", usage).group(1))
    instructions, loops = loop_bodies(sass)
    return dict(registers=field("REG"), local_bytes=field("LOCAL"), shared_bytes=kernel.metadata.shared,
                sass_instructions=len(instructions), loops=[b - a for a, b in loops],
                loop_ops=[collections.Counter(opcode(i) for i in instructions[a:b]) for a, b in loops])


def ttir_pipeline(ir: str, target, options) -> str:
    """``ir`` after Triton's own TTIR passes (``make_ttir``: combine, canonicalize, CSE), as text: ``triton.compile``
    skips them for IR input, and without them ``acc + dot(p, v)`` is not fused into the dot's accumulator."""
    from triton._C.libtriton import ir as tir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    context = tir.context()
    tir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as f:
        f.write(ir)
        f.flush()
        module = tir.parse_mlir_module(f.name, context)
    module.context = context
    backend.make_ttir(module, {}, backend.parse_options(options), target.arch)
    return str(module)


def loop_bodies(sass: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The instructions of ``nvdisasm`` output, and the [start, end) range of each loop body in them (a branch back
    to an earlier label), in code order."""
    instructions, labels, loops = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            instructions.append(re.sub(r"^\s+/\*[0-9a-f]+\*/\s*", "", line).strip())
            back = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
            if back and back.group(1) in labels and len(instructions) - labels[back.group(1)] > 1:
                loops.append((labels[back.group(1)], len(instructions)))
    return instructions, loops


def opcode(instruction: str) -> str:
    """``@P0 FMNMX R1, ...`` -> ``FMNMX``; HGMMA shapes and modifiers of other opcodes are kept."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].rstrip(";")


def knob_value(text: str):
    """``--knob`` values: ints, ``True``/``False``, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def prefill_report(specs, warps: int, stages: int, knobs: dict):
    """The whole kernel of each layout, then each width class compiled alone (one class: its loops are easy to
    name) with its steady-state loop's instructions per score and opcode mix."""
    print("| layout | classes | registers | spilled bytes | shared bytes | SASS instructions | loop bodies |\n"
          "|---|---|---|---|---|---|---|")
    for spec in specs:
        layout = layout_of(spec)
        r = resources(prefill_ir(layout, num_warps=warps, **knobs), warps, stages)
        print(f"| {spec} | {len(width_classes(layout)[0])} | {r['registers']} | {r['local_bytes']} | "
              f"{r['shared_bytes']} | {r['sass_instructions']} | {' '.join(map(str, r['loops']))} |", flush=True)
    ops = ("MUFU.EX2", "HGMMA", "FMNMX", "FADD", "FFMA", "FMUL", "F2FP")
    print("\nSteady-state (unmasked) loop of each class compiled alone; opcode columns count its body, per score "
          "= per (row, key) pair a thread owns in one step (rows x keys / threads).\n")
    print(f"| layout | K/V width | heads | rows x keys | registers | steady | masked | instr/score | "
          f"{' | '.join(ops)} | other |\n|{'---|' * (9 + len(ops))}")
    for spec in specs:
        layout = layout_of(spec)
        classes, _ = width_classes(layout)
        total = weight = 0
        for cls in classes:
            alone = HeadLayout(HQ, HKV, D, (cls.k_width,) * HKV, (cls.v_width,) * HKV)
            r = resources(prefill_ir(alone, num_warps=warps, **knobs), warps, stages)
            rows, keys = prefill_tile(cls, knobs)
            steady, counts = r["loops"][0], r["loop_ops"][0]
            per_score = steady / (rows * keys / (warps * 32))
            total, weight = total + per_score * len(cls.heads), weight + len(cls.heads)
            mix = [sum(n for op, n in counts.items() if op.startswith(name)) for name in ops]
            print(f"| {spec} | {cls.k_width}/{cls.v_width} | {len(cls.heads)} | {rows}x{keys} | {r['registers']} | "
                  f"{steady} | {r['loops'][1]} | {per_score:.2f} | {' | '.join(map(str, mix))} | "
                  f"{steady - sum(mix)} |", flush=True)
        if len(classes) > 1:
            print(f"| {spec} | mean over heads | {weight} | | | | | {total / weight:.2f} |{' |' * (len(ops) + 1)}")


def prefill_tile(cls, knobs: dict) -> tuple[int, int]:
    """(query rows, keys) of one loop step of a class at T 4096, bf16, as ``prefill_attention`` picks them
    (``knobs``: the bench's defaults with the command line's on top)."""
    segs = knobs["max_segments"]
    rows = block_rows(cls, knobs["block_q"], 4096, knobs.get("balanced", True), knobs["max_block_q"], segs)
    cols = loaded_columns(cls.k_width, segs) + loaded_columns(cls.v_width, segs)
    return rows, keys_per_step(knobs["block_k"], rows, cols, 2, knobs["num_stages"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("layouts", nargs="+", help="rate:R, uniform:W or widths:K,K,../V,V,.. (cycled over 8 KV heads)")
    ap.add_argument("--kernel", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--warps", type=int, help="default: 4 (decode), the bench's prefill knobs' 8 (prefill)")
    ap.add_argument("--stages", type=int, help="default: 3")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                    help="a paged_decode (prefill_attention) keyword, e.g. --knob block_tokens=32 (repeatable), or "
                         "pack_tile (the decode schedule's)")
    args = ap.parse_args(argv)
    knobs = {k: knob_value(v) for k, v in (kv.split("=", 1) for kv in args.knob)}
    if args.kernel == "prefill":
        from bench.kernels import PREFILL_DEFAULTS

        warps = args.warps or knobs.pop("num_warps", PREFILL_DEFAULTS["num_warps"])
        stages = args.stages or knobs.pop("num_stages", PREFILL_DEFAULTS["num_stages"])
        knobs = {**{k: v for k, v in PREFILL_DEFAULTS.items() if k not in ("num_warps", "num_stages")}, **knobs,
                 "num_stages": stages}
        print(f"prefill_attention, sm_90, batch 1, T 4096, bf16, writing pages, {warps} warps, {stages} stages, "
              f"knobs {knobs}\n")
        return prefill_report(args.layouts, warps, stages, knobs)
    warps, stages = args.warps or 4, args.stages or 3
    print(f"paged_decode, sm_90, {warps} warps, {stages} stages, knobs {knobs or 'default'}\n")
    print("| layout | classes | registers | spilled bytes | shared bytes | SASS instructions | loop bodies |\n"
          "|---|---|---|---|---|---|---|")
    for spec in args.layouts:
        layout = layout_of(spec)
        ir = triton_ir(layout, num_warps=warps, num_stages=stages, **knobs)
        r = resources(ir, warps, stages)
        classes = len(run_classes(layout, knobs.get("pack_tile", PACK_TILE))[0])
        print(f"| {spec} | {classes} | {r['registers']} | {r['local_bytes']} | "
              f"{r['shared_bytes']} | {r['sass_instructions']} | {' '.join(map(str, r['loops']))} |", flush=True)


if __name__ == "__main__":
    main()
