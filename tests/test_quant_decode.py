"""The quantized paged decode kernel against the jnp reference (interpret mode on the CPU; compiled on a GPU)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.models.rotation import packed_query
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.quant_kernel import (
    QUANT_DECODE,
    QuantDecodeOp,
    QuantKernelConfig,
    head_classes,
    plan_config,
    quantized_paged_decode,
    unit_kernels,
)
from kvjax.ops.decode.reference import quantized_decode_attention
from kvjax.ops.decode.schedule import build_decode_schedule
from kvjax.ops.lowering import triton_modules
from kvjax.ops.quant import PageFormat

_encode = jax.jit(PageFormat.encode, static_argnums=0)  # op by op it takes seconds on the CPU


def quant_inputs(rng, layout, lengths, fmt, dtype, spare_pages=1, encode=_encode, far_out=0.0):
    """Random (never zero) q, pages encoded (``encode(fmt, K, V)``) from random K and V (each column its own offset
    and spread, so scales and zeros differ; a share ``far_out`` of entries 8x further out), each sequence's pages
    scattered through the pool, and random tails."""
    b, p = len(lengths), fmt.page_size
    pps = -(-max(lengths) // p) + spare_pages
    num_pages = b * pps + 1

    def kv(cols):
        x = rng.standard_normal((num_pages, p, cols)) * rng.uniform(0.5, 2.0, cols) + rng.uniform(-1.0, 1.0, cols)
        x = np.where(rng.random(x.shape) < far_out, x * 8, x)
        return jnp.asarray(x, jnp.float32)

    pages = encode(fmt, kv(fmt.k_cols), kv(fmt.v_cols))
    tail = jnp.asarray(rng.standard_normal((b, p, fmt.k_cols + fmt.v_cols)), dtype)
    q = jnp.asarray(rng.standard_normal((b, layout.q_cols)), dtype)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(b, pps).astype(np.int32))
    return q, pages, tail, table, jnp.asarray(lengths, jnp.int32)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


_reference = jax.jit(quantized_decode_attention, static_argnames=("fmt", "layout"))


def reference(q, pages, tail, fmt, table, lengths, layout):
    """The reference in float32 at full precision (jitted: op by op it takes seconds on the CPU)."""
    with jax.default_matmul_precision("highest"):
        return _reference(q.astype(jnp.float32), pages, tail.astype(jnp.float32), fmt, table, lengths, layout)


def tolerance(dtype):
    return 1e-4 if dtype == jnp.float32 else 2e-2


MIXED = HeadLayout(4, 2, 64, (32, 16), (16, 48))  # group size 2, mixed widths within the layer
SMALL = QuantKernelConfig(chunk_tokens=16, step_tokens=64, narrow_step_tokens=32)  # several chunks a step
CASES = {
    # name: (layout, bits, page size, cache dtype, lengths, programs, kernel). Lengths: 1 (tail only), whole pages
    # (an empty tail), inside a page, long ones split across the few programs and merged.
    "int4 p16 f32": (MIXED, 4, 16, jnp.float32, [1, 16, 37, 150], 6, SMALL),
    # one kernel switching between the layer's classes instead of one kernel a class
    "int4 p16 f32 switch": (
        MIXED,
        4,
        16,
        jnp.float32,
        [1, 16, 37, 150],
        6,
        dataclasses.replace(SMALL, classes_per_kernel=8),
    ),
    "int2 p32 bf16 window": (
        dataclasses.replace(MIXED, sliding_window=100),
        2,
        32,
        jnp.bfloat16,
        [300, 70, 5, 1],
        6,
        SMALL,
    ),
    # one chunk a step, heads of 64 and 32 columns (a 16-byte K row at int4)
    "int4 p32 bf16": (HeadLayout(4, 2, 64, (64, 32), (32, 64)), 4, 32, jnp.bfloat16, [96, 33], 4, QuantKernelConfig()),
    # 2-bit planes of 16 and 32 columns beside a head too narrow for them (its columns gathered)
    "int2 p32 bf16 planes": (
        HeadLayout(6, 3, 128, (64, 128, 16), (128, 48, 64)),
        2,
        32,
        jnp.bfloat16,
        [300, 33],
        6,
        QuantKernelConfig(),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_decode_matches_reference(name):
    layout, bits, p, dtype, lengths, programs, kernel = CASES[name]
    seed = fresh_seed()
    fmt = PageFormat.for_layout(layout, p, bits)
    q, pages, tail, table, lens = quant_inputs(np.random.default_rng(seed), layout, lengths, fmt, dtype)
    config = dataclasses.replace(QUANT_DECODE, order="lpt", min_chunk_tokens=p)
    classes = [unit_kernels(layout, bits, config, kernel.classes_per_kernel)]  # as QuantDecodeOp schedules
    built = build_decode_schedule(lengths, layout, p, programs, config=config, headroom_pages=1, classes=classes)
    assert (built.schedule.merge_dest[..., 0] >= 0).any()  # some groups were split, so the merge ran
    out = quantized_paged_decode(
        q, pages, tail, table, lens, built.schedule.layer(0), layout, fmt, kernel=kernel, interpret=True
    )
    assert out.shape == (len(lengths), layout.out_cols) and out.dtype == dtype
    err = rel_err(out, reference(q, pages, tail, fmt, table, lens, layout))
    assert err < tolerance(dtype), f"seed {seed}: relative error {err}"


# runs of adjacent heads read as one unit (``plan_config(packed=True)``): G = 4 with a run of three and a head alone,
# G = 2 with runs of two, int2 runs of four 16-column heads (planes of 4 columns a head, 16 a run); then runs of
# mixed widths: G = 4 (a head alone, then three of 16-64 columns), G = 2 in a window, int2 at G = 2 and int4 at G = 1
# (runs of four: ``RUN_HEADS``)
MIXED_K, MIXED_V = (16, 32, 16, 64, 16, 16, 32, 16), (64, 16, 32, 16, 16, 48, 16, 16)
PACKED = {
    "mixed int4 G4 f32": (HeadLayout(16, 4, 64, (32, 16, 48, 64), (16, 32, 16, 64)), 4, 16, jnp.float32, [150, 37]),
    "mixed int4 G2 bf16 window": (
        HeadLayout(8, 4, 64, (16, 48, 32, 32), (32, 32, 16, 48), 90),
        4,
        32,
        jnp.bfloat16,
        [200, 5, 64],
    ),
    "mixed int2 G2 f32": (HeadLayout(16, 8, 64, MIXED_K, MIXED_V), 2, 16, jnp.float32, [140, 1, 33]),
    "mixed int4 G1 f32": (HeadLayout(8, 8, 64, MIXED_K, MIXED_V), 4, 16, jnp.float32, [100, 17]),
    "int4 G4 f32": (HeadLayout(16, 4, 64, (32, 32, 32, 64), (16, 16, 16, 64)), 4, 16, jnp.float32, [1, 16, 37, 150]),
    "int4 G2 bf16 window": (
        HeadLayout(8, 4, 64, (48, 48, 16, 16), (32, 32, 64, 64), 90),
        4,
        32,
        jnp.bfloat16,
        [200, 5, 64],
    ),
    "int2 G4 f32": (HeadLayout(16, 4, 64, (16, 16, 16, 16), (32, 32, 32, 32)), 2, 16, jnp.float32, [150, 33]),
}


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_runs_match_reference(name):
    """A run of heads is one unit: its rows the heads' queries, each masked to its own head's columns of the run's
    planes, each row's value scales its own head's; alone, split and merged, with tails, and with a wide q."""
    layout, bits, p, dtype, lengths = PACKED[name]
    config = dataclasses.replace(plan_config(QUANT_DECODE, bits, True), order="lpt", min_chunk_tokens=p)
    assert any(len(c) == 3 for c in head_classes(layout, bits, config)), "no run to test"
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    fmt = PageFormat.for_layout(layout, p, bits)
    q, pages, tail, table, lens = quant_inputs(rng, layout, lengths, fmt, dtype)
    built = build_decode_schedule(lengths, layout, p, 5, config=config, headroom_pages=1)
    assert (built.schedule.merge_dest[..., 0] >= 0).any()  # some groups were split, so the merge ran
    run = functools.partial(quantized_paged_decode, kernel=SMALL, interpret=True)
    out = run(q, pages, tail, table, lens, built.schedule.layer(0), layout, fmt)
    err = rel_err(out, reference(q, pages, tail, fmt, table, lens, layout))
    assert err < tolerance(dtype), f"seed {seed}: relative error {err}"
    if dtype == jnp.float32:
        wide = jnp.asarray(rng.standard_normal((len(lengths), layout.num_heads, layout.k_cols)), jnp.float32)
        got = run(wide, pages, tail, table, lens, built.schedule.layer(0), layout, fmt)
        want = run(packed_query(wide, layout), pages, tail, table, lens, built.schedule.layer(0), layout, fmt)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# two layers, one kernel: heads at other offsets, and V heads of 48 and 64 columns in one class (planes of 24 and 32
# in tiles of 32, the plane width read at run time)
LAYERS = (HeadLayout(4, 2, 64, (32, 16), (16, 48)), HeadLayout(4, 2, 64, (16, 64), (64, 16)))


def test_op_runs_every_layer_and_a_wide_query_gives_the_packed_querys_output():
    """One QuantDecodeOp over two layers whose heads sit at other offsets (one shared kernel, its offsets read from
    tables), pages of 8 tokens: each layer equals the reference, and a wide q (``QKRotation.wide``: every head on
    every packed K column) gives its packed q's output exactly."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lengths = [24, 3, 41]
    config = dataclasses.replace(QUANT_DECODE, min_chunk_tokens=8, kernel_classes=8)
    one_chunk = QuantKernelConfig(chunk_tokens=16, step_tokens=16, narrow_step_tokens=16)  # a smaller trace
    # pages of 8 tokens: chunks of 8 in tiles of 16 rows
    op = QuantDecodeOp(
        LAYERS, 8, 11, bits=4, max_batch=3, config=config, kernel=one_chunk, num_programs=3, interpret=True
    )
    assert set(op.groups[LAYERS[0]]) == set(op.groups[LAYERS[1]]) == set(LAYERS)
    assert head_classes(LAYERS[0], 4)[1] == head_classes(LAYERS[1], 4)[0] == (("gather", 16), ("planes", 32))
    schedule = op.schedule(np.asarray(lengths))
    for i, layout in enumerate(LAYERS):
        fmt = op.formats[layout]
        q, pages, tail, table, lens = quant_inputs(rng, layout, lengths, fmt, jnp.float32)
        out = op.run(q, pages, tail, table, lens, schedule.layer(i), layout)
        err = rel_err(out, reference(q, pages, tail, fmt, table, lens, layout))
        assert err < 1e-4, f"seed {seed}, layer {i}: relative error {err}"
        if i:
            continue  # one layer's wide q is enough (each form compiles the kernel again)
        wide = jnp.asarray(rng.standard_normal((len(lengths), layout.num_heads + 1, layout.k_cols)), jnp.float32)
        out = op.run(wide, pages, tail, table, lens, schedule.layer(i), layout)
        packed = op.run(packed_query(wide, layout), pages, tail, table, lens, schedule.layer(i), layout)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(packed))


def test_layers_lower_to_one_kernel_a_class():
    """With a kernel a head class (``classes_per_kernel`` 1), every layer's kernel of a class lowers to the same
    Triton IR, so XLA compiles one per class for the model: two layers of two classes each, three distinct."""
    lengths = [40, 300]
    op = QuantDecodeOp(LAYERS, 16, 20, bits=4, max_batch=2, num_programs=4)
    schedule = op.schedule(np.asarray(lengths))
    rng = np.random.default_rng(0)
    inputs = [quant_inputs(rng, lay, lengths, op.formats[lay], jnp.bfloat16) for lay in LAYERS]

    def layers(schedule, *arrays):
        return [op.run(*arrays[5 * i : 5 * i + 5], schedule.layer(i), lay) for i, lay in enumerate(LAYERS)]

    modules = triton_modules(layers, (schedule, *[x for case in inputs for x in case]))
    classes = [sorted(set(head_classes(lay, 4))) for lay in LAYERS]
    assert [len(c) for c in classes] == [2, 2] and len({c for cs in classes for c in cs}) == 3
    decode = [m for m in modules if "kvjax_quantized_decode" in m]
    assert len(decode) == 4 and len(set(decode)) == 3, [len(m) for m in decode]


def test_wrong_formats_configs_and_layouts_are_refused():
    layout = MIXED
    fmt = PageFormat.for_layout(layout, 16, 4)
    q, pages, tail, table, lens = quant_inputs(np.random.default_rng(fresh_seed()), layout, [20], fmt, jnp.float32)
    schedule = build_decode_schedule([20], layout, 16, 2, config=QUANT_DECODE).schedule.layer(0)
    other = PageFormat((16, 32), (16, 48), 16, 4)
    with pytest.raises(ValueError, match="do not match the layout"):
        quantized_paged_decode(q, pages, tail, table, lens, schedule, layout, other, interpret=True)
    with pytest.raises(ValueError, match="pages must be uint8"):  # pages of another bit width
        quantized_paged_decode(q, pages, tail, table, lens, schedule, layout, PageFormat.for_layout(layout, 16, 2))
    with pytest.raises(ValueError, match="pack_tile=0"):
        QuantDecodeOp([layout], 16, 4, config=DECODE)
    with pytest.raises(ValueError, match="pack_min_cols >= 64"):  # int2 runs need 4 codes a byte x 16 columns
        QuantDecodeOp([layout], 16, 4, bits=2, config=plan_config(QUANT_DECODE, 4, True))
    packed = build_decode_schedule([20], layout, 16, 2, config=dataclasses.replace(DECODE, pack_tile=64))
    with pytest.raises(ValueError, match="pack_tile=0"):
        quantized_paged_decode(q, pages, tail, table, lens, packed.schedule.layer(0), layout, fmt, interpret=True)
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantDecodeOp([layout], 16, 4, bits=3)
    op = QuantDecodeOp([layout], 16, 4, interpret=True)
    with pytest.raises(ValueError, match="not one of the layouts"):
        op.run(q, pages, tail, table, lens, schedule, LAYERS[1])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
def test_quantized_decode_on_gpu(bits):
    """Compiled, on a bigger shape: four width classes."""
    layout = HeadLayout(16, 8, 128, (128, 48, 16, 128, 48, 16, 128, 64), (16, 96, 128, 16, 96, 128, 16, 64))
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3000, 12)
    lengths[:3] = (1, 32, 64)
    fmt = PageFormat.for_layout(layout, 32, bits)
    q, pages, tail, table, lens = quant_inputs(rng, layout, lengths, fmt, jnp.bfloat16)
    op = QuantDecodeOp([layout], 32, table.shape[1], bits=bits, max_batch=len(lengths))
    out = op.run(q, pages, tail, table, lens, op.schedule(lengths).layer(0), layout)
    err = rel_err(out, reference(q, pages, tail, fmt, table, lens, layout))
    assert err < 2e-2, f"seed {seed}: relative error {err}"
