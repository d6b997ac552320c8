"""What a kernel costs the H100 before it runs, found on a CPU: the registers, spills, shared memory, code size and
the SASS instructions of each loop body of ``paged_decode`` (with ``--kernel quant --bits 4``, of
``quantized_paged_decode``, with its compile time; with ``--kernel prefill``, ``prefill_attention``
and each of its width classes compiled alone, with its steady-state loop's instructions per score and opcode mix;
with ``--kernel quant-head`` and ``--kernel palu``, the loop's barriers too),
for layouts given on the command line, lowered by Pallas for CUDA sm_90 here and compiled by the ``triton``
package's own compiler and ptxas (``pip install triton``; not a kvjax dependency). Device time is scarce and a
width-mixed kernel takes a minute to compile there, so questions such as which width class sets the register count
are answered here; this Triton is not the exact build inside jaxlib, so expect the same trends and similar numbers
(bench/results/kernels.md "Decode: registers and code size (offline)", "Decode: instructions per step by tile shape
(offline)")."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import HKV, HQ, D, count_arg, knob_option, pick_layer, rank_plan, uniform, with_knobs
from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.quant_kernel import (
    QUANT_DECODE,
    QUANT_KERNEL,
    QuantKernelConfig,
    head_classes,
    plan_config,
    quantized_paged_decode,
)
from kvjax.ops.decode.schedule import build_decode_schedule
from kvjax.ops.decode.tables import run_classes
from kvjax.ops.decode.units import head_runs
from kvjax.ops.lowering import triton_modules
from kvjax.ops.prefill.config import PREFILL, PrefillConfig
from kvjax.ops.prefill.kernel import prefill_attention
from kvjax.ops.prefill.work import block_rows, class_of, keys_per_step, tile_classes
from kvjax.ops.quant import PageFormat
from kvjax.ops.tiles import tile

EPILOG = """examples:
  python -m bench.resources rate:0.5 uniform:64 widths:80,48/96,32 [--warps 4 --stages 3]
  python -m bench.resources --kernel prefill rate:0.5 uniform:64 uniform:128 [--knob block_k=64]
  python -m bench.resources --kernel quant --bits 4 rate:0.5 uniform:128 [--knob narrow_step_tokens=128]
  python -m bench.resources --kernel quant-head --bits 4 uniform:128 uniform:64 --group 16 32 [--step-groups 1]
  python -m bench.resources --kernel quant-head-model rate:0.5 --group 32 [--layers 8]
  python -m bench.resources --kernel gear --gear gear2-r1-o0.01-p128 uniform:128 rate:0.5 [--warps 8]
  python -m bench.resources --kernel palu uniform:64 rate:0.5

Layouts: rate:R (the bench's representative layer of a rate-R plan), uniform:W, or widths:K,K,../V,V,.. (cycled
over the 8 KV heads). Each decode row gives the SASS instructions in the body of every loop of the kernel (a loop
is a backward branch), first to last: for a layout of one class, the first is the steady-state step (every token
visible), the second its masked twin, the third the loop over a program's items. The prefill report gives the
whole kernel's row, then each width class compiled alone, whose first loop is its steady-state (unmasked) step,
with instructions per score (rows x keys / threads) and its MUFU.EX2 / HGMMA / FMNMX / FADD / FFMA / FMUL / F2FP
counts."""


def warps_arg(val: str) -> int:
    """An argparse ``type=`` for ``--warps``: a positive power of 2, as Triton takes (anything else is refused in one
    line, not by Triton's assertion deep in a compile)."""
    warps = count_arg("--warps")(val)
    if warps & (warps - 1):
        raise argparse.ArgumentTypeError(f"--warps takes a power of 2, got {warps}")
    return warps


def _rate(val: str) -> float:
    """A rate:R spec's R, refused in one line unless a number in [0, 1)."""
    try:
        rate = float(val)
    except ValueError:
        rate = -1.0
    if not 0 <= rate < 1:
        raise SystemExit(f"rate:R takes a rate in [0, 1), got {val!r}")
    return rate


def layout_of(spec: str) -> HeadLayout:
    """The layout a command-line spec names: rate:R, uniform:W or widths:K,../V,.. (cycled over the KV heads)."""
    kind, _, val = spec.partition(":")
    if kind == "uniform":
        return uniform(int(val))
    if kind == "rate":
        return pick_layer(rank_plan(_rate(val)), _rate(val))
    if kind == "widths":
        k, v = ([int(x) for x in part.split(",")] for part in val.split("/"))
        return HeadLayout(HQ, HKV, D, *(tuple(ws[h % len(ws)] for h in range(HKV)) for ws in (k, v)))
    raise SystemExit(f"unknown layout {spec!r}: use rate:R, uniform:W or widths:K,../V,..")


def triton_ir(layout: HeadLayout, config: DecodeConfig = DECODE, batch=32, ctx=4096, page_size=32) -> str:
    """The Triton IR Pallas builds for ``paged_decode`` on this layout, planned and run with ``config``."""
    pps = ctx // page_size
    pages = batch * pps + 1
    plan = build_decode_schedule(np.full(batch, ctx), layout, page_size, config=config).schedule.layer(0)
    bf16 = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((batch, layout.q_cols), bf16),
        jax.ShapeDtypeStruct((pages, page_size, layout.k_cols), bf16),
        jax.ShapeDtypeStruct((pages, page_size, layout.v_cols), bf16),
        jax.ShapeDtypeStruct((batch, pps), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        plan,
    )
    return lowered_ir(lambda *a: paged_decode(*a, layout), args)


def _paged_args(layout: HeadLayout, fmt, batch: int, ctx: int) -> tuple:
    """The shapes a quantized decode call takes for ``batch`` sequences of ``ctx`` tokens in ``fmt``'s pages: q (bf16,
    packed), the pool, the tails, the block table and the lengths."""
    pps = ctx // fmt.page_size
    return (
        jax.ShapeDtypeStruct((batch, layout.q_cols), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch * pps + 1, fmt.page_bytes), jnp.uint8),
        jax.ShapeDtypeStruct((batch, fmt.page_size, fmt.k_cols + fmt.v_cols), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, pps), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


def quant_ir(
    layout: HeadLayout, bits: int, kernel: QuantKernelConfig, batch=32, ctx=4096, page_size=32, packed=False
) -> list[str]:
    """The Triton IR of every decode kernel ``quantized_paged_decode`` runs on this layout's ``bits``-bit pages (the
    layout alone): one a group of ``kernel.classes_per_kernel`` head classes, the merge left out; ``packed``: runs of
    adjacent heads a unit (``quant_kernel.plan_config``)."""
    fmt = PageFormat.for_layout(layout, page_size, bits)
    config = plan_config(QUANT_DECODE, bits, packed)
    plan = build_decode_schedule(np.full(batch, ctx), layout, page_size, config=config).schedule.layer(0)
    args = (*_paged_args(layout, fmt, batch, ctx), plan)
    modules = triton_modules(
        lambda q, p, t, b, n, s: quantized_paged_decode(q, p, t, b, n, s, layout, fmt, kernel=kernel), args
    )
    return [m for m in modules if "kvjax_quantized_decode" in m]


def quant_report(specs, bits: int, kernel: QuantKernelConfig, packed: bool = False) -> None:
    """One row a layout: its head classes, its kernels (one a class, or a switch over several: ``classes_per_kernel``),
    their IR lines, the most registers and spills of any, their SASS instructions, and their offline compile time
    summed, which grows with the square of a kernel's size (Triton's Coalesce pass; bench/results/quantization.md
    "Quantized pages: compile times (offline)"); then, with a kernel a class, each kernel's largest loop body (the chunk
    loop: a step of ``chunks_per_step`` chunks) over the (token, head) pairs a step visits, summed over the layer's
    units as the instructions a token of the layer costs every warp, and the time 4 schedulers on each of an H100's SMs
    need to issue them at B32 x 8K (``ISSUE``): the kernel is bound by issue (bench/results/quantization.md "Quantized
    pages: instructions per (token, head) (offline)")."""
    print(
        "| layout | head classes | kernels | IR lines | registers | spilled bytes | SASS instructions | compile s "
        "| loop instructions a (token, head) | a layer token | issue us at B32 x 8K | top opcodes |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    config = plan_config(QUANT_DECODE, bits, packed)
    for spec in specs:
        layout = layout_of(spec)
        irs = quant_ir(layout, bits, kernel, packed=packed)
        rs = [resources(ir, kernel.num_warps, kernel.num_stages) for ir in irs]
        classes = head_classes(layout, bits, config)
        loop = " | | | |"
        if kernel.classes_per_kernel == 1 and all(r["loops"] for r in rs):
            per_pair, per_token, top = [], 0.0, collections.Counter()
            for cls, r in zip(sorted(set(classes)), rs):
                count, body_ops = largest_loop(r)
                runs = [run for run, c in zip(head_runs(layout, config), classes) if c == cls]
                tiles = [_side_tile(side, bits) for side in cls[:2]]
                tokens = kernel.chunks_per_step(*tiles, 32) * kernel.chunk(32)
                per_token += count / tokens * len(runs)
                per_pair.append(f"{count / (tokens * runs[0].num_heads):.1f}")
                top.update(body_ops)
            issue = per_token * ISSUE["batch"] * ISSUE["ctx"] * kernel.num_warps / ISSUE["issue_per_s"]
            loop = f" {' / '.join(per_pair)} | {per_token:.0f} | {issue * 1e6:.0f} | {top_ops(top)} |"
        print(
            f"| {spec} | {len(set(classes))} | {len(irs)} | "
            f"{sum(ir.count(chr(10)) for ir in irs)} | {max(r['registers'] for r in rs)} | "
            f"{max(r['local_bytes'] for r in rs)} | {sum(r['sass_instructions'] for r in rs)} | "
            f"{sum(r['compile_s'] for r in rs):.1f} |" + loop,
            flush=True,
        )


def prefill_ir(layout: HeadLayout, config: PrefillConfig = PREFILL, batch=1, t=4096, page_size=32) -> str:
    """The Triton IR of ``prefill_attention`` as the bench times it (bf16, writing the prompt's K/V pages)."""
    pps = t // page_size
    bf16 = jnp.bfloat16
    args = tuple(jax.ShapeDtypeStruct((batch, t, c), bf16) for c in (layout.q_cols, layout.k_cols, layout.v_cols))
    args += (
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        *(jax.ShapeDtypeStruct((batch * pps + 1, page_size, c), bf16) for c in (layout.k_cols, layout.v_cols)),
        jax.ShapeDtypeStruct((batch, pps), jnp.int32),
    )
    return lowered_ir(lambda q, k, v, *rest: prefill_attention(q, k, v, layout, *rest, config=config), args)


def lowered_ir(fn, args) -> str:
    """The Triton IR of the first Pallas kernel in ``fn(*args)``, lowered for CUDA sm_90 without a GPU."""
    return triton_modules(fn, args)[0]


# what ``quant_report`` prices issue at: B32 x 8K, 132 SMs of 4 schedulers at 1.755 GHz (an H100 SXM)
ISSUE = dict(batch=32, ctx=8192, issue_per_s=132 * 4 * 1.755e9)


def _side_tile(side, bits: int) -> int:
    """The tile columns a quantized side is read into (all its planes' tiles, or its gathered tile)."""
    form, size = side
    return size * (8 // bits) if form == "planes" else tile(size)


def resources(ir: str, warps: int, stages: int) -> dict:
    """Registers, spills, shared memory, SASS instructions and loop bodies (``loop_ops``) of ``ir`` built for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    target = GPUTarget("cuda", 90, 32)
    options = {"num_warps": warps, "num_stages": stages}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as f:
            f.write(ttir_pipeline(ir, target, options))
        start = time.perf_counter()
        kernel = triton.compile(src, target=target, options=options)
        compile_s = time.perf_counter() - start
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
        ).stdout

    def field(name):
        return int(re.search(rf"\b{name}:(\d+)", usage).group(1))

    instructions, loops = loop_bodies(sass)
    return dict(
        registers=field("REG"),
        local_bytes=field("LOCAL"),
        shared_bytes=kernel.metadata.shared,
        sass_instructions=len(instructions),
        compile_s=compile_s,  # Triton's passes, LLVM and ptxas on this CPU
        loops=[b - a for a, b in loops],
        loop_ops=[collections.Counter(opcode(i) for i in instructions[a:b]) for a, b in loops],
    )


def ttir_pipeline(ir: str, target, options) -> str:
    """``ir`` after Triton's own TTIR passes (``make_ttir``: combine, canonicalize, CSE), as text."""
    # jaxlib runs them; ``triton.compile`` skips them for IR input, and without them ``acc + dot(p, v)`` is not fused
    # into the dot's accumulator (every prefill K piece cost one FADD per score)
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
    """The instructions of ``nvdisasm`` output and the [start, end) of each loop body (a branch back), in order."""
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


def largest_loop(r: dict) -> tuple[int, collections.Counter]:
    """A ``resources`` result's largest loop body (a kernel's chunk loop): its instructions and opcode counts."""
    body = max(range(len(r["loops"])), key=lambda i: r["loops"][i])
    return r["loops"][body], r["loop_ops"][body]


def top_ops(ops: collections.Counter, n: int = 5) -> str:
    """The ``n`` most frequent opcodes of a loop body, as a table cell."""
    return ", ".join(f"{op} {k}" for op, k in ops.most_common(n))


def barriers(ops: collections.Counter) -> int:
    """A loop body's barriers (``BAR.SYNC`` and kin): each holds a program's warps until all arrive, the cost of a
    reduction across warps or of a tile's trip through shared memory."""
    return sum(n for op, n in ops.items() if op.startswith("BAR"))


def opcode(instruction: str) -> str:
    """``@P0 FMNMX R1, ...`` -> ``FMNMX``; HGMMA shapes and modifiers of other opcodes are kept."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].rstrip(";")


def prefill_report(specs, config: PrefillConfig):
    """Each layout's whole kernel, then each width class alone with its steady loop's instructions per score."""
    warps, stages = config.num_warps, config.num_stages
    print(
        "| layout | classes | registers | spilled bytes | shared bytes | SASS instructions | loop bodies |\n"
        "|---|---|---|---|---|---|---|"
    )
    for spec in specs:
        layout = layout_of(spec)
        r = resources(prefill_ir(layout, config), warps, stages)
        print(
            f"| {spec} | {len(tile_classes([layout], config.tile_widths))} | {r['registers']} | {r['local_bytes']} | "
            f"{r['shared_bytes']} | {r['sass_instructions']} | {' '.join(map(str, r['loops']))} |",
            flush=True,
        )
    ops = ("MUFU.EX2", "HGMMA", "FMNMX", "FADD", "FFMA", "FMUL", "F2FP")
    print(
        "\nSteady-state (unmasked) loop of each class compiled alone; opcode columns count its body, per score "
        "= per (row, key) pair a thread owns in one step (rows x keys / threads).\n"
    )
    print(
        f"| layout | K/V width | heads | rows x keys | registers | steady | masked | instr/score | "
        f"{' | '.join(ops)} | other |\n|{'---|' * (9 + len(ops))}"
    )
    for spec in specs:
        layout = layout_of(spec)
        classes = tile_classes([layout], config.tile_widths)
        heads = class_of(layout, classes, config.tile_widths)
        total = weight = 0
        for index, cls in enumerate(classes):
            n = heads.count(index)
            alone = HeadLayout(HQ, HKV, D, (cls.k_tile,) * HKV, (cls.v_tile,) * HKV)
            r = resources(prefill_ir(alone, config), warps, stages)
            rows, keys = prefill_tile(cls, config)
            steady, counts = r["loops"][0], r["loop_ops"][0]
            per_score = steady / (rows * keys / (warps * 32))
            total, weight = total + per_score * n, weight + n
            mix = [sum(n for op, n in counts.items() if op.startswith(name)) for name in ops]
            print(
                f"| {spec} | {cls.k_tile}/{cls.v_tile} | {n} | {rows}x{keys} | {r['registers']} | "
                f"{steady} | {r['loops'][1]} | {per_score:.2f} | {' | '.join(map(str, mix))} | "
                f"{steady - sum(mix)} |",
                flush=True,
            )
        if len(classes) > 1:
            print(f"| {spec} | mean over heads | {weight} | | | | | {total / weight:.2f} |{' |' * (len(ops) + 1)}")


def prefill_tile(cls, config: PrefillConfig) -> tuple[int, int]:
    """(query rows, keys) of one loop step of a tile class at T 4096, bf16, as ``prefill_attention`` picks them."""
    rows = block_rows(cls, config.block_q, 4096, config.balanced, config.max_block_q)
    return rows, keys_per_step(config.block_k, rows, cls.cols, 2, config.num_stages)


def changes(config, default) -> dict:
    """The fields of ``config`` that differ from ``default``."""
    return {k: v for k, v in dataclasses.asdict(config).items() if v != getattr(default, k)}


def gear_report(specs, name: str, warps: int) -> None:
    """One row a layout for GEAR's decode kernel (``ops.decode.gear_kernel``, a kernel a (K, V) width pair) over
    pages of the scheme ``name``: its kernels, the most registers and spills, SASS instructions, compile time, and
    the page loop's instructions over the page's tokens (a (token, head) of each pair, then summed over the layer's
    heads), priced in issue time at B32 x 8K as ``quant_report`` prices the KIVI-style kernel
    (bench/results/quantization.md "GEAR pages: decode kernel (offline)")."""
    from kvjax.ops import kv_schemes
    from kvjax.ops.decode.gear_kernel import gear_paged_decode
    from kvjax.ops.pallas_util import width_pairs

    print(
        "| layout | kernels | registers | spilled bytes | SASS instructions | compile s | loop instructions a "
        "(token, head) | a layer token | issue us at B32 x 8K | top opcodes |\n" + "|---" * 10 + "|"
    )
    for spec in specs:
        layout = layout_of(spec)
        fmt = kv_schemes.page_format(name, layout, kv_schemes.page_of(name) or 32)
        p = fmt.page_size
        args = _paged_args(layout, fmt, 32, 4096)
        irs = triton_modules(functools.partial(gear_paged_decode, layout=layout, fmt=fmt, num_warps=warps), args)
        rs = [resources(ir, warps, 1) for ir in irs]
        per_pair = [max(r["loops"]) / p for r in rs]  # kernels in width_pairs' order
        per_token = sum(x * len(heads) for x, (_, heads) in zip(per_pair, width_pairs(layout)))
        issue = per_token * ISSUE["batch"] * ISSUE["ctx"] * warps / ISSUE["issue_per_s"]
        top = collections.Counter()
        for r in rs:
            top.update(largest_loop(r)[1])
        print(
            f"| {spec} | {len(irs)} | {max(r['registers'] for r in rs)} | {max(r['local_bytes'] for r in rs)} | "
            f"{sum(r['sass_instructions'] for r in rs)} | {sum(r['compile_s'] for r in rs):.1f} | "
            f"{' / '.join(f'{x:.0f}' for x in per_pair)} | {per_token:.0f} | {issue * 1e6:.0f} | "
            f"{top_ops(top)} |",
            flush=True,
        )


def quant_head_args(layout: HeadLayout, batch: int, ctx: int, group: int, page_bytes: int) -> tuple:
    """``quant_head_decode``'s (q, pool, tail, tables, stored) as shapes: ``batch`` sequences of ``ctx`` slots a head,
    a page a group."""
    hkv, pages = layout.num_kv_heads, -(-ctx // group)
    return (
        jax.ShapeDtypeStruct((batch, layout.q_cols), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch * hkv * pages + 1, page_bytes), jnp.uint8),
        jax.ShapeDtypeStruct((batch, group, layout.k_cols + layout.v_cols), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, hkv, pages), jnp.int32),
        jax.ShapeDtypeStruct((batch, hkv), jnp.int32),
    )


def quant_head_report(specs, bits: int, groups, warps: int, stages: int, step_groups: int | None = None) -> None:
    """One row a (layout, group): ``quant_head_decode`` (eviction's quantized per-head pages, one kernel switching
    between the layout's width pairs) lowered at B32 x 4K and compiled for sm_90, its registers, spills and SASS
    instructions, and its chunk loop (the largest loop body: a step of ``groups_a_step`` groups of ``group`` slots)
    over the slots a step visits, as ``quant_report`` prices the per-sequence kernel's: instructions a (token, head)
    every warp issues, and the time 4 schedulers on each of an H100's SMs need for them at B32 x 8K (``ISSUE``;
    bench/results/eviction.md "Eviction on quantized pages: instructions a (slot, head) (offline)").
    ``step_groups``: groups a loop step (``quant_head_decode``'s; default ``groups_a_step``'s)."""
    from kvjax.ops import quant_head_paging
    from kvjax.ops.decode.quant_head_kernel import _reader, groups_a_step, quant_head_decode

    print(
        "| layout | group | registers | spilled bytes | SASS instructions | compile s | groups a step | loop "
        "instructions | barriers a step | a (token, head) | issue us at B32 x 8K | top opcodes |\n" + "|---" * 12 + "|"
    )
    batch, ctx = 32, 4096
    for spec in specs:
        layout = layout_of(spec)
        if len(set(zip(layout.k_widths, layout.v_widths))) > 1:
            raise SystemExit(
                f"--kernel quant-head prices one width pair a layout (uniform:W or widths:K/V), got {spec}"
            )
        for group in groups:
            page_bytes = quant_head_paging.pool_page_bytes([layout], group, bits)
            hkv = layout.num_kv_heads
            args = quant_head_args(layout, batch, ctx, group, page_bytes)
            kw = dict(layout=layout, page_bytes=page_bytes, group=group, bits=bits, num_warps=warps, num_stages=stages)
            kw |= dict(step_groups=step_groups)
            irs = [m for m in triton_modules(functools.partial(quant_head_decode, **kw), args) if "quant_head" in m]
            (r,) = [resources(ir, warps, stages) for ir in irs]
            reader = _reader(layout.k_widths[0], layout.v_widths[0], bits, jnp.bfloat16)
            nc = step_groups or groups_a_step(reader, group)
            loop, ops = largest_loop(r)
            per_pair = loop / (nc * group)
            issue = per_pair * hkv * ISSUE["batch"] * ISSUE["ctx"] * warps / ISSUE["issue_per_s"]
            print(
                f"| {spec} | {group} | {r['registers']} | {r['local_bytes']} | {r['sass_instructions']} | "
                f"{r['compile_s']:.1f} | {nc} | {loop} | {barriers(ops)} | "
                f"{per_pair:.1f} | {issue * 1e6:.0f} | {top_ops(ops)} |",
                flush=True,
            )


def palu_report(specs, step: int, warps: int, stages: int) -> None:
    """One row a (layout, K tile class): ``palu_decode`` (Palu's kernel: K rebuilt from its latent, RoPE, scores)
    lowered at B32 x 4K over pages of 16 and compiled for sm_90, its registers, its loop (a step of ``step`` tokens)
    and the instructions a (token, head) every warp issues there, its barriers a step and the time 4 schedulers on
    each of an H100's SMs need to issue the class's share at B32 x 8K (``ISSUE``; bench/results/kernels.md "Palu's
    decode kernel")."""
    from kvjax.ops.palu import head_classes as palu_classes
    from kvjax.ops.palu import palu_decode

    print(
        "| layout | K tile class (heads) | registers | loop instructions | barriers a step | a (token, head) | "
        "issue us at B32 x 8K | top opcodes |\n" + "|---" * 8 + "|"
    )
    batch, ctx, page = 32, 4096, 16
    for spec in specs:
        layout = layout_of(spec)
        d, pages = layout.head_dim, batch * ctx // page
        args = (
            jax.ShapeDtypeStruct((batch, layout.num_heads * d), jnp.bfloat16),
            jax.ShapeDtypeStruct((pages, page, layout.k_cols), jnp.bfloat16),
            jax.ShapeDtypeStruct((pages, page, layout.v_cols), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, ctx // page), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            [jax.ShapeDtypeStruct((w, d), jnp.bfloat16) for w in layout.k_widths],
            jax.ShapeDtypeStruct((d // 2,), jnp.float32),
        )
        fn = functools.partial(palu_decode, layout=layout, splits=2, step=step, num_warps=warps, num_stages=stages)
        irs = [m for m in triton_modules(fn, args) if "palu" in m]
        for heads, ir in zip(palu_classes(layout), irs):
            r = resources(ir, warps, stages)
            loop, ops = largest_loop(r)
            per_pair = loop / step
            issue = per_pair * len(heads) * ISSUE["batch"] * ISSUE["ctx"] * warps / ISSUE["issue_per_s"]
            tile_k = tile(max(layout.k_widths[h] for h in heads))
            print(
                f"| {spec} | {tile_k} ({len(heads)}) | {r['registers']} | {loop} | "
                f"{barriers(ops)} | {per_pair:.1f} | {issue * 1e6:.0f} | {top_ops(ops)} |",
                flush=True,
            )


MODEL_FORMS = ("own", "layer", "k-class", "class")  # --kernel quant-head-model's launch forms (``--forms``)


def quant_head_model_report(
    specs, bits: int, groups, warps: int, stages: int, layers: int | None, forms=MODEL_FORMS
) -> None:
    """One row a (plan, group, launch form): the Triton compile a whole model's ``quant_head_decode`` needs, the
    modules XLA compiles (it compiles each distinct module once: its kernel cache is keyed by the module) with their
    seconds summed. "a layer, own classes": one launch switching between the classes of the layer's own pairs (a
    module per set of classes); "a layer, model's classes": the engine's (its ``pairs`` name the model's classes:
    one module); "a K class": a launch a K class of the layer, a module a K class of the model (its classes
    branches); "a class": a launch a class of the layer, a module a class of the model. ``specs``: rate:R (the
    ordered plan of ``bench.harness.rank_plan``, every layer; ``layers``: only its first so many) or uniform:W
    (bench/notes/2026-12-06-quant-head-compile.md); ``forms``: which of these (``MODEL_FORMS``, in that order)."""
    from kvjax.ops import quant_head_paging
    from kvjax.ops.decode.quant_head_kernel import quant_head_decode
    from kvjax.ops.pallas_util import width_pairs

    print(
        "| plan | layers | group | launches | modules | compile s (Triton, summed) | largest module s |\n"
        + "|---" * 7
        + "|"
    )
    batch, ctx = 32, 4096
    for spec in specs:
        kind, _, val = spec.partition(":")
        lays = rank_plan(_rate(val)) if kind == "rate" else (layout_of(spec),) * 32
        lays = lays[:layers] if layers else lays
        pairs = tuple(sorted({p for lay in lays for p, _ in width_pairs(lay)}))
        for group in groups:
            page_bytes = quant_head_paging.pool_page_bytes(lays, group, bits)
            every = (
                ("own", "a layer, own classes", None, "layer"),
                ("layer", "a layer, model's classes", pairs, "layer"),
                ("k-class", "a K class", pairs, "k-class"),
                ("class", "a class", pairs, "class"),
            )
            for form, given, launches in [(label, p, f) for key, label, p, f in every if key in forms]:
                modules: set[str] = set()
                for lay in lays:
                    args = quant_head_args(lay, batch, ctx, group, page_bytes)
                    kw = dict(layout=lay, page_bytes=page_bytes, group=group, bits=bits, num_warps=warps)
                    fn = functools.partial(quant_head_decode, num_stages=stages, pairs=given, launches=launches, **kw)
                    modules.update(m for m in triton_modules(fn, args) if "quant_head" in m)
                seconds = [resources(m, warps, stages)["compile_s"] for m in modules]
                print(
                    f"| {spec} | {len(lays)} | {group} | {form} | {len(modules)} | {sum(seconds):.0f} | "
                    f"{max(seconds):.1f} |",
                    flush=True,
                )


def main(argv=None):
    """The command line: one table row per layout (decode), or the prefill report."""
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("layouts", nargs="+", help="rate:R, uniform:W or widths:K,K,../V,V,.. (cycled over 8 KV heads)")
    ap.add_argument(
        "--kernel",
        choices=("decode", "quant", "quant-head", "quant-head-model", "prefill", "gear", "palu"),
        default="decode",
    )
    ap.add_argument(
        "--layers", type=count_arg("--layers"), help="--kernel quant-head-model: only a plan's first so many layers"
    )
    ap.add_argument(
        "--step-groups",
        type=count_arg("--step-groups"),
        help="--kernel quant-head: groups a loop step (default: the kernel's, 4 or 2 at groups of 32)",
    )
    ap.add_argument(
        "--forms",
        nargs="+",
        choices=MODEL_FORMS,
        default=list(MODEL_FORMS),
        help="--kernel quant-head-model: launch forms to compile (own: a layer of its own classes; layer: of the "
        "model's; k-class: a launch a K class; class: a launch a class; default all)",
    )
    ap.add_argument(
        "--group", type=int, nargs="+", default=[16], help="--kernel quant-head: slots a quantized group (default 16)"
    )
    ap.add_argument("--gear", default="gear2-r1-o0.01-p128", help="--kernel gear: the GEAR scheme of the pages")
    ap.add_argument("--bits", type=int, choices=(4, 2), default=4, help="code width of --kernel quant (default 4)")
    ap.add_argument(
        "--warps",
        type=warps_arg,
        help=f"a power of 2; default: DECODE's {DECODE.num_warps} (decode), PREFILL's {PREFILL.num_warps} (prefill)",
    )
    ap.add_argument("--stages", type=int, help=f"default: DECODE's {DECODE.num_stages}, PREFILL's {PREFILL.num_stages}")
    knob_option(
        ap,
        "a DecodeConfig (PrefillConfig, QuantKernelConfig) field, e.g. --knob block_tokens=32 or --knob pack_tile=128",
    )
    ap.add_argument("--packed", action="store_true", help="--kernel quant: runs of adjacent heads a unit (plan_config)")
    args = ap.parse_args(argv)
    knobs = [*args.knob, *([f"num_warps={args.warps}"] if args.warps else [])]
    knobs += [f"num_stages={args.stages}"] if args.stages else []
    if importlib.util.find_spec("triton") is None:
        raise SystemExit(
            "resources.py compiles the lowered kernels with the triton package's compiler and ptxas: "
            "pip install triton (it is not a kvjax dependency)"
        )
    if args.kernel == "quant":
        kernel = with_knobs(QUANT_KERNEL, knobs)
        print(
            f"quantized_paged_decode, int{args.bits}, sm_90, B32 x 4K, pages of 32, {kernel.num_warps} warps, "
            f"{kernel.num_stages} stages, QUANT_KERNEL with {changes(kernel, QUANT_KERNEL) or 'nothing changed'}\n"
        )
        return quant_report(args.layouts, args.bits, kernel, args.packed)
    if args.kernel == "quant-head":
        warps, stages = args.warps or 4, args.stages or 2
        print(f"quant_head_decode, int{args.bits}, sm_90, B32 x 4K, {warps} warps, {stages} stages\n")
        return quant_head_report(args.layouts, args.bits, args.group, warps, stages, args.step_groups)
    if args.kernel == "quant-head-model":
        warps, stages = args.warps or 4, args.stages or 2
        print(f"quant_head_decode over a model, int{args.bits}, sm_90, B32 x 4K, {warps} warps, {stages} stages\n")
        return quant_head_model_report(args.layouts, args.bits, args.group, warps, stages, args.layers, args.forms)
    if args.kernel == "palu":
        from kvjax.ops.palu import STEP, WARPS

        warps, stages = args.warps or WARPS, args.stages or 2
        print(f"palu_decode, sm_90, B32 x 4K, pages of 16, {STEP} tokens a step, {warps} warps, {stages} stages\n")
        return palu_report(args.layouts, STEP, warps, stages)
    if args.kernel == "gear":
        warps = args.warps or 4
        print(f"gear_paged_decode, {args.gear} pages, sm_90, {warps} warps, 1 stage\n")
        return gear_report(args.layouts, args.gear, warps)
    if args.kernel == "prefill":
        config = with_knobs(PREFILL, knobs)
        print(
            f"prefill_attention, sm_90, batch 1, T 4096, bf16, writing pages, {config.num_warps} warps, "
            f"{config.num_stages} stages, PREFILL with {changes(config, PREFILL) or 'nothing changed'}\n"
        )
        return prefill_report(args.layouts, config)
    config = with_knobs(DECODE, knobs)
    print(
        f"paged_decode, sm_90, {config.num_warps} warps, {config.num_stages} stages, DECODE with "
        f"{changes(config, DECODE) or 'nothing changed'}\n"
    )
    print(
        "| layout | classes | registers | spilled bytes | shared bytes | SASS instructions | loop bodies |\n"
        "|---|---|---|---|---|---|---|"
    )
    for spec in args.layouts:
        layout = layout_of(spec)
        r = resources(triton_ir(layout, config), config.num_warps, config.num_stages)
        classes = len(run_classes((layout,), config))
        print(
            f"| {spec} | {classes} | {r['registers']} | {r['local_bytes']} | "
            f"{r['shared_bytes']} | {r['sass_instructions']} | {' '.join(map(str, r['loops']))} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
