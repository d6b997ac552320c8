"""The Pallas paged decode kernel against the jnp reference (interpret mode on the CPU; compiled on a GPU)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.layout import HeadLayout
from kvjax.models.rotation import packed_query
from kvjax.ops import attention
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.decode.schedule import build_decode_schedule, static_decode_schedule
from kvjax.ops.decode.tables import kernel_groups, run_classes
from kvjax.ops.lowering import triton_modules
from kvjax.ops.tiles import segments, tile

GPU = jax.default_backend() == "gpu"


def paged_inputs(rng, layout, lengths, page_size, dtype, spare_pages=1):
    """Random (never zero) q and pages; each sequence's pages scattered through the pool."""
    b = len(lengths)
    pps = -(-max(lengths) // page_size) + spare_pages
    num_pages = b * pps + 1
    k = jnp.asarray(rng.standard_normal((num_pages, page_size, layout.k_cols)), dtype)
    v = jnp.asarray(rng.standard_normal((num_pages, page_size, layout.v_cols)), dtype)
    q = jnp.asarray(rng.standard_normal((b, layout.q_cols)), dtype)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(b, pps).astype(np.int32))
    return q, k, v, table, jnp.asarray(lengths, jnp.int32)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def reference(q, k, v, table, lengths, layout):
    def f32(x):
        return x.astype(jnp.float32)

    with jax.default_matmul_precision("highest"):
        return paged_decode_attention(f32(q), f32(k), f32(v), table, lengths, layout)


CASES = {
    # name: (layout, lengths, page_size, dtype, programs, order, headroom, min_chunk_tokens)
    "G4 odd widths ragged p16 bf16": (
        HeadLayout(8, 2, 64, (48, 16), (16, 64)),
        [1, 37, 130],
        16,
        jnp.bfloat16,
        4,
        "lpt",
        1,
        16,
    ),
    "G1 window p16 f32": (
        HeadLayout(3, 3, 32, (32, 16, 32), (16, 32, 32), sliding_window=20),
        [70, 19, 3],
        16,
        jnp.float32,
        5,
        "lpt",
        0,
        16,
    ),
    "G8 split chunks p32 f32": (HeadLayout(8, 1, 64, (64,), (48,)), [700], 32, jnp.float32, 8, "lpt", 1, 32),
    "G2 naive order p32 bf16": (
        HeadLayout(4, 2, 64, (32, 64), (64, 16)),
        [33, 64, 65, 1],
        32,
        jnp.bfloat16,
        3,
        "naive",
        0,
        32,
    ),
    "G3 ragged p16 f32": (HeadLayout(6, 2, 64, (16, 64), (32, 16)), [5, 90, 200], 16, jnp.float32, 4, "lpt", 1, 16),
    "G4 stream order p16 bf16": (
        HeadLayout(8, 2, 64, (32, 64), (48, 16)),
        [300, 7, 41],
        16,
        jnp.bfloat16,
        6,
        "stream",
        1,
        16,
    ),
    "G2 pieces 112/80 p16 f32": (
        HeadLayout(4, 2, 128, (112, 80), (96, 48)),
        [3, 77, 150],
        16,
        jnp.float32,
        3,
        "lpt",
        1,
        16,
    ),
}


# fold_tokens 16: token chunks folded into the score tile's spare rows; max_segments 3: heads may be read as exact
# power-of-two pieces (only where they save enough: test_pieces_only_where_they_save_columns), 1: as one padded tile;
# unmasked False: every step in the masked loop
@pytest.mark.parametrize("fold_tokens, max_segments, unmasked", [(16, 3, True), (64, 1, True), (16, 2, False)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_matches_reference(name, fold_tokens, max_segments, unmasked):
    layout, lengths, ps, dtype, programs, order, headroom, min_chunk = CASES[name]
    rng = np.random.default_rng()
    q, k, v, table, lens = paged_inputs(rng, layout, lengths, ps, dtype)
    config = dataclasses.replace(
        DECODE,
        order=order,
        min_chunk_tokens=min_chunk,
        block_tokens=16,
        max_step_tokens=64,
        fold_tokens=fold_tokens,
        max_segments=max_segments,
        unmasked_steps=unmasked,
    )
    built = build_decode_schedule(lengths, layout, ps, programs, config=config, headroom_pages=headroom)
    out = paged_decode(q, k, v, table, lens, built.schedule.layer(0), layout, interpret=True)
    assert out.shape == (len(lengths), layout.out_cols) and out.dtype == dtype
    assert rel_err(out, reference(q, k, v, table, lens, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)


PACKED = {
    # name: (layout, lengths, page_size, dtype, pack_tile, max_segments): runs of adjacent heads read as one
    # (kvjax.ops.decode.units)
    "G2 four narrow heads, split and folded, f32": (
        HeadLayout(8, 4, 64, (16, 32, 48, 16), (32, 16, 16, 48)),
        [300, 2, 97],
        16,
        jnp.float32,
        64,
        1,
    ),
    "G1 window, runs of up to 3, bf16": (
        HeadLayout(5, 5, 32, (16, 16, 32, 16, 16), (16, 32, 16, 16, 16), sliding_window=40),
        [130, 9],
        16,
        jnp.bfloat16,
        64,
        1,
    ),
    "G4 odd widths, f32": (HeadLayout(12, 3, 128, (48, 80, 32), (96, 32, 16)), [1, 200, 513], 32, jnp.float32, 128, 1),
    # a 160 + 144 run through 256-column tiles, read as pieces 128 + 32 and 128 + 16
    "G4 run in pieces, f32": (HeadLayout(8, 2, 128, (80, 80), (96, 48)), [40, 333], 16, jnp.float32, 256, 2),
}


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_runs_match_reference(name):
    """Runs of heads share one score tile (each row masked to its head's columns of q) and one K and V tile."""
    layout, lengths, ps, dtype, pack_tile, max_segments = PACKED[name]
    rng = np.random.default_rng()
    q, k, v, table, lens = paged_inputs(rng, layout, lengths, ps, dtype)
    config = dataclasses.replace(
        DECODE,
        order="stream",
        min_chunk_tokens=16,
        pack_tile=pack_tile,
        block_tokens=16,
        max_step_tokens=64,
        fold_tokens=16,
        max_segments=max_segments,
    )
    built = build_decode_schedule(lengths, layout, ps, 5, config=config, headroom_pages=1)
    assert built.schedule.items[0, :, :, 1].max() < layout.num_kv_heads - 1  # heads did pack into runs
    out = paged_decode(q, k, v, table, lens, built.schedule.layer(0), layout, interpret=True)
    assert rel_err(out, reference(q, k, v, table, lens, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)


def test_runs_of_other_head_counts_share_a_class_where_they_do_not_fold():
    """Runs read through the same tiles share one code path whatever their head counts, unless the code folds
    token chunks into spare rows (which depends on the count), and the shared path gives each run its own output."""
    layout = HeadLayout(9, 3, 64, (32, 32, 64), (32, 32, 64))  # runs: heads 0-1 (64 + 64 columns), head 2 (64 + 64)
    base = dataclasses.replace(
        DECODE, order="stream", min_chunk_tokens=16, pack_tile=64, block_tokens=16, max_step_tokens=64
    )
    folded, unfolded = (dataclasses.replace(base, fold_tokens=f) for f in (16, 64))
    assert [c.num_heads for c in run_classes((layout,), folded)] == [2, 1]
    assert [c.num_heads for c in run_classes((layout,), unfolded)] == [0]
    rng = np.random.default_rng()
    q, k, v, table, lens = paged_inputs(rng, layout, [150, 33], 16, jnp.bfloat16)
    for config in (folded, unfolded):
        built = build_decode_schedule([150, 33], layout, 16, 3, config=config, headroom_pages=1)
        out = paged_decode(q, k, v, table, lens, built.schedule.layer(0), layout, interpret=True)
        assert rel_err(out, reference(q, k, v, table, lens, layout)) < 1e-2


# Layers of one model whose runs cut to different tiles: they share one decode and one merge kernel.
LAYERS = (
    HeadLayout(8, 2, 64, (48, 16), (16, 64)),
    HeadLayout(8, 2, 64, (32, 64), (64, 48)),
    HeadLayout(8, 2, 64, (64, 64), (64, 64)),
    HeadLayout(8, 2, 64, (16, 16), (32, 16)),
)
LAYERS_CONFIG = dataclasses.replace(
    DECODE, min_chunk_tokens=16, pack_tile=64, block_tokens=16, max_step_tokens=64, fold_tokens=16, kernel_classes=16
)


def layers_case(lengths, dtype, seed=None, interpret=True):
    """A DecodeOp over ``LAYERS`` with few programs (so groups split and merge), its schedule for ``lengths``, and
    each layer's random inputs."""
    rng = np.random.default_rng(seed)
    op = DecodeOp(
        LAYERS,
        16,
        -(-max(lengths) // 16) + 1,
        max_batch=len(lengths),
        config=LAYERS_CONFIG,
        num_programs=3,
        interpret=interpret,
    )
    inputs = [paged_inputs(rng, lay, lengths, 16, dtype) for lay in LAYERS]
    return op, op.schedule(np.asarray(lengths)), inputs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_layer_of_a_shared_kernel_matches_the_reference(dtype):
    """One DecodeOp runs layers of other widths through the kernels compiled for all of them: each layer's output
    equals the reference, with groups split across programs and merged."""
    lengths = [90, 7, 200]
    op, schedule, inputs = layers_case(lengths, dtype)
    assert (schedule.merge_dest[..., 0] >= 0).any()  # some groups were split, so the merge ran
    for i, (layout, (q, k, v, table, lens)) in enumerate(zip(LAYERS, inputs)):
        out = op.run(q, k, v, table, lens, schedule.layer(i), layout)
        assert out.shape == (len(lengths), layout.out_cols)
        tol = 1e-4 if dtype == jnp.float32 else 1e-2
        assert rel_err(out, reference(q, k, v, table, lens, layout)) < tol, layout


def test_a_wide_query_gives_the_packed_querys_output():
    """ZACK's wide q (every head on every packed K column, ``QKRotation.wide``) gives each layer the output of its
    packed q, exactly: the kernel reads each head's own columns, whatever the other columns hold."""
    lengths = [90, 7, 200]
    op, schedule, inputs = layers_case(lengths, jnp.bfloat16)
    rng = np.random.default_rng()
    for i, (layout, (_, k, v, table, lens)) in enumerate(zip(LAYERS, inputs)):
        wide = jnp.asarray(rng.standard_normal((len(lengths), layout.num_heads + 1, layout.k_cols)), jnp.bfloat16)
        out = op.run(wide, k, v, table, lens, schedule.layer(i), layout)
        packed = op.run(packed_query(wide, layout), k, v, table, lens, schedule.layer(i), layout)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(packed, np.float32))
    with pytest.raises(ValueError, match="a wide q must be"):
        op.run(wide[:, :2], k, v, table, lens, schedule.layer(0), LAYERS[0])


def test_layers_of_other_widths_lower_to_one_kernel():
    """The decode and merge kernels of every layer lower to the same Triton IR, so XLA compiles each once for the
    model, not once per layer (bench/results/startup.md "Engine: compile times")."""
    op, schedule, inputs = layers_case([40, 300], jnp.bfloat16, seed=0, interpret=False)

    def layers(schedule, *arrays):
        return [op.run(*arrays[5 * i : 5 * i + 5], schedule.layer(i), lay) for i, lay in enumerate(LAYERS)]

    modules = triton_modules(layers, (schedule, *[x for case in inputs for x in case]))
    assert len(modules) == 2 * len(LAYERS)  # a decode and a merge kernel per layer
    assert len(set(modules[0::2])) == 1 and len(set(modules[1::2])) == 1


def test_lowering_finds_the_triton_dialect_without_searching_the_import_path(monkeypatch):
    """The Pallas lowering builds every op without a failed module lookup (``pallas_util.register_triton_dialect``):
    without it, MLIR's bindings searched the import path for the dialect's module at every op, as they never
    remember a miss."""
    op, schedule, inputs = layers_case([40, 300], jnp.bfloat16, seed=0, interpret=False)

    def layers(schedule, *arrays):
        return [op.run(*arrays[5 * i : 5 * i + 5], schedule.layer(i), lay) for i, lay in enumerate(LAYERS[:2])]

    class Spy:  # sees every import the module cache does not answer
        def __init__(self):
            self.names = []

        def find_spec(self, name, path=None, target=None):
            self.names.append(name)

    spy = Spy()
    monkeypatch.setattr(sys, "meta_path", [spy, *sys.meta_path])
    assert triton_modules(layers, (schedule, *[x for case in inputs[:2] for x in case]))
    assert not [name for name in spy.names if name.endswith(".tt")]  # the dialect's module, under any prefix


def test_a_layout_outside_the_op_or_the_shared_ones_is_refused():
    op, schedule, inputs = layers_case([20], jnp.float32, seed=0)
    other = HeadLayout(8, 2, 64, (16, 48), (16, 16))
    q, k, v, table, lens = paged_inputs(np.random.default_rng(), other, [20], 16, jnp.float32)
    with pytest.raises(ValueError, match="not one of the layouts this decode op was built for"):
        op.run(q, k, v, table, lens, schedule.layer(0), other)
    with pytest.raises(ValueError, match="one of the shared layouts"):
        paged_decode(q, k, v, table, lens, schedule.layer(0), other, interpret=True, shared=LAYERS)


@pytest.mark.parametrize("cap", [1, 2, 3, 5])
def test_kernel_groups_share_within_their_classes(cap):
    """Layers whose runs fall in the same classes share kernels; groups hold at most ``kernel_classes`` classes
    unless one layer alone has more; every layer is in its own group."""
    rng = np.random.default_rng()
    widths = [16, 32, 48, 64]
    layouts = [HeadLayout(8, 4, 64, tuple(rng.choice(widths, 4)), tuple(rng.choice(widths, 4))) for _ in range(12)]
    config = dataclasses.replace(LAYERS_CONFIG, kernel_classes=cap)
    groups = kernel_groups(layouts, config)
    for layout in layouts:
        group = groups[layout]
        assert layout in group and all(groups[other] == group for other in group)
        classes = run_classes(group, config)
        assert len(classes) <= max(cap, max(len(run_classes((lay,), config)) for lay in group))
        same = [
            o
            for o in layouts
            if {c.key for c in run_classes((o,), config)} == {c.key for c in run_classes((layout,), config)}
        ]
        assert all(o in group for o in same)


@pytest.mark.parametrize("max_segments", [1, 2, 3])
@pytest.mark.parametrize("min_saving", [0, 16, 64])
def test_pieces_cover_the_width_and_save_what_they_cost(max_segments, min_saving):
    """A width is read as power-of-two pieces that cover exactly its columns, widest first, at most max_segments
    of them, and more than one only where each extra piece saves min_saving columns of the one tile."""
    for width in range(16, 257, 16):
        pieces = segments(width, max_segments, min_saving)
        assert 1 <= len(pieces) <= max_segments
        assert [start for start, _, _ in pieces] == [sum(t for _, t, _ in pieces[:i]) for i in range(len(pieces))]
        assert sum(cols for _, _, cols in pieces) == width
        assert all(t == tile(t) and 0 < cols <= t for _, t, cols in pieces)
        assert [t for _, t, _ in pieces] == sorted((t for _, t, _ in pieces), reverse=True)
        if len(pieces) > 1:
            assert tile(width) - sum(t for _, t, _ in pieces) >= min_saving * (len(pieces) - 1)


def test_one_schedule_serves_growing_lengths():
    """A schedule with a spare page stays valid as sequences grow into it (the kernel reads lengths at run time)."""
    layout = HeadLayout(4, 2, 32, (16, 32), (32, 16))
    rng = np.random.default_rng()
    lengths = np.array([10, 31])
    q, k, v, table, _ = paged_inputs(rng, layout, lengths + 16, 16, jnp.float32)
    built = build_decode_schedule(
        lengths, layout, 16, 3, config=dataclasses.replace(DECODE, min_chunk_tokens=16), headroom_pages=1
    )
    for grown in (lengths, lengths + 6):
        assert built.covers(grown)
        lens = jnp.asarray(grown, jnp.int32)
        out = paged_decode(q, k, v, table, lens, built.schedule.layer(0), layout, interpret=True)
        assert rel_err(out, reference(q, k, v, table, lens, layout)) < 1e-4


def test_attention_seam_with_a_length_blind_schedule():
    """attention.decode inside jit: the new token's K/V written at length - 1, then the op's kernel with the
    trace-time schedule built at the table's full width; the same out and pages as the reference path."""
    layout = HeadLayout(4, 2, 32, (32, 16), (16, 32))
    rng = np.random.default_rng()
    q, k_pages, v_pages, table, lens = paged_inputs(rng, layout, [5, 40], 16, jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((2, layout.k_cols)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((2, layout.v_cols)), jnp.float32)
    schedule = static_decode_schedule(2, table.shape[1], layout, 16, 4)
    ops = {"interpret": DecodeOp([layout], 16, table.shape[1], num_programs=4, interpret=True), "reference": None}
    outs = {}
    for backend, op in ops.items():
        step = jax.jit(lambda *a, op=op: attention.decode(*a, op=op, schedule=schedule), static_argnums=3)
        outs[backend] = step(q, k_new, v_new, layout, k_pages, v_pages, table, lens)
    (out, kp, vp), (ref, kp_ref, vp_ref) = outs["interpret"], outs["reference"]
    assert rel_err(out, ref) < 1e-4
    assert np.array_equal(kp, kp_ref) and np.array_equal(vp, vp_ref)
    page, slot = table[1, (40 - 1) // 16], (40 - 1) % 16  # sequence 1's new token sits at position 39
    assert np.array_equal(kp[page, slot], k_new[1]) and np.array_equal(vp[page, slot], v_new[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_on_gpu(dtype):
    layout = HeadLayout(32, 8, 128, (128, 48, 16, 80, 112, 32, 64, 96), (16, 96, 128, 48, 64, 112, 80, 32))
    rng = np.random.default_rng()
    lengths = rng.integers(1, 5000, 16)
    q, k, v, table, lens = paged_inputs(rng, layout, lengths, 32, dtype)
    built = build_decode_schedule(lengths, layout, 32, headroom_pages=1)
    out = paged_decode(q, k, v, table, lens, built.schedule.layer(0), layout)
    assert rel_err(out, reference(q, k, v, table, lens, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_slot_refilled_with_a_shorter_windowed_sequence_gets_a_new_schedule(batch_invariant):
    """Continuous batching hands a slot to a shorter sequence: a kept sliding-window schedule starts past its window."""
    layout = HeadLayout(4, 2, 16, (16, 16), (16, 16), sliding_window=5)
    op = DecodeOp([layout], 4, 16, batch_invariant=batch_invariant, interpret=True)
    rng = np.random.default_rng()
    for lengths in ([30], [5], [13], [40], [6]):
        q, k, v, table, lens = paged_inputs(rng, layout, lengths, 4, jnp.float32)
        table = jnp.pad(table, ((0, 0), (0, 16 - table.shape[1])))
        out = op.run(q, k, v, table, lens, op.schedule(np.asarray(lengths)).layer(0), layout)
        assert rel_err(out, reference(q, k, v, table, lens, layout)) < 1e-4, lengths
