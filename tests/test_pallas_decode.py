"""The Pallas paged decode kernel against the jnp reference (interpret mode on the CPU; compiled on a GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax.layout import HeadLayout
from kvjax.pallas.decode import paged_decode, paged_decode_reference
from kvjax.runs import PIECE_SAVING, segments
from kvjax.schedule import build_decode_schedule, static_decode_schedule

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
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        return paged_decode_reference(f32(q), f32(k), f32(v), table, lengths, layout)


CASES = {
    # name: (layout, lengths, page_size, dtype, programs, order, headroom, min_chunk_tokens)
    "G4 odd widths ragged p16 bf16": (HeadLayout(8, 2, 64, (48, 16), (16, 64)), [1, 37, 130], 16, jnp.bfloat16, 4,
                                      "lpt", 1, 16),
    "G1 window p16 f32": (HeadLayout(3, 3, 32, (32, 16, 32), (16, 32, 32), sliding_window=20), [70, 19, 3], 16,
                          jnp.float32, 5, "lpt", 0, 16),
    "G8 split chunks p32 f32": (HeadLayout(8, 1, 64, (64,), (48,)), [700], 32, jnp.float32, 8, "lpt", 1, 32),
    "G2 naive order p32 bf16": (HeadLayout(4, 2, 64, (32, 64), (64, 16)), [33, 64, 65, 1], 32, jnp.bfloat16, 3,
                                "naive", 0, 32),
    "G3 ragged p16 f32": (HeadLayout(6, 2, 64, (16, 64), (32, 16)), [5, 90, 200], 16, jnp.float32, 4, "lpt", 1, 16),
    "G4 stream order p16 bf16": (HeadLayout(8, 2, 64, (32, 64), (48, 16)), [300, 7, 41], 16, jnp.bfloat16, 6,
                                 "stream", 1, 16),
    "G2 pieces 112/80 p16 f32": (HeadLayout(4, 2, 128, (112, 80), (96, 48)), [3, 77, 150], 16, jnp.float32, 3,
                                 "lpt", 1, 16),
}


# fold_tokens 16: token chunks folded into the score tile's spare rows; max_segments 3: heads may be read as exact
# power-of-two pieces (only where they save enough: test_pieces_only_where_they_save_columns), 1: as one padded tile
@pytest.mark.parametrize("fold_tokens, max_segments", [(16, 3), (64, 1)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_matches_reference(name, fold_tokens, max_segments):
    layout, lengths, ps, dtype, programs, order, headroom, min_chunk = CASES[name]
    rng = np.random.default_rng()
    q, k, v, table, lens = paged_inputs(rng, layout, lengths, ps, dtype)
    plan = build_decode_schedule(lengths, layout, ps, programs, order=order, headroom_pages=headroom,
                                 min_chunk_tokens=min_chunk)
    out = paged_decode(q, k, v, table, lens, plan.schedule.layer(0), layout, block_tokens=16, max_step_tokens=64,
                       fold_tokens=fold_tokens, max_segments=max_segments, interpret=True)
    assert out.shape == (len(lengths), layout.out_cols) and out.dtype == dtype
    assert rel_err(out, reference(q, k, v, table, lens, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)


PACKED = {
    # name: (layout, lengths, page_size, dtype, pack_tile, max_segments): runs of adjacent heads read as one
    # (kvjax.runs)
    "G2 four narrow heads, split and folded, f32": (HeadLayout(8, 4, 64, (16, 32, 48, 16), (32, 16, 16, 48)),
                                                    [300, 2, 97], 16, jnp.float32, 64, 1),
    "G1 window, runs of up to 3, bf16": (HeadLayout(5, 5, 32, (16, 16, 32, 16, 16), (16, 32, 16, 16, 16),
                                                    sliding_window=40), [130, 9], 16, jnp.bfloat16, 64, 1),
    "G4 odd widths, f32": (HeadLayout(12, 3, 128, (48, 80, 32), (96, 32, 16)), [1, 200, 513], 32, jnp.float32, 128,
                           1),
    # a 160 + 144 run through 256-column tiles, read as pieces 128 + 32 and 128 + 16
    "G4 run in pieces, f32": (HeadLayout(8, 2, 128, (80, 80), (96, 48)), [40, 333], 16, jnp.float32, 256, 2),
}


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_runs_match_reference(name):
    """Runs of heads share one score tile (each row masked to its head's columns of q) and one K and V tile."""
    layout, lengths, ps, dtype, pack_tile, max_segments = PACKED[name]
    rng = np.random.default_rng()
    q, k, v, table, lens = paged_inputs(rng, layout, lengths, ps, dtype)
    plan = build_decode_schedule(lengths, layout, ps, 5, headroom_pages=1, min_chunk_tokens=16, pack_tile=pack_tile,
                                 order="stream")
    assert plan.schedule.items[0, :, :, 1].max() < layout.num_kv_heads - 1  # heads did pack into runs
    out = paged_decode(q, k, v, table, lens, plan.schedule.layer(0), layout, block_tokens=16, max_step_tokens=64,
                       fold_tokens=16, max_segments=max_segments, interpret=True)
    assert rel_err(out, reference(q, k, v, table, lens, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)


def test_pieces_only_where_they_save_columns():
    """Decode reads a unit as pieces only where each extra one saves PIECE_SAVING columns of the one tile."""
    assert segments(160, 2, PIECE_SAVING) == ((0, 128, 128), (128, 32, 32))
    assert segments(144, 3, PIECE_SAVING) == ((0, 128, 128), (128, 16, 16))
    assert segments(112, 3, PIECE_SAVING) == ((0, 128, 112),)  # 64 + 32 + 16 saves 16 columns for two pieces
    assert segments(80, 2, PIECE_SAVING) == ((0, 128, 80),)
    assert segments(80, 2) == ((0, 64, 64), (64, 16, 16))  # prefill's rule: any saving


def test_one_plan_serves_growing_lengths():
    """A plan with a spare page stays valid as sequences grow into it (the kernel reads lengths at run time)."""
    layout = HeadLayout(4, 2, 32, (16, 32), (32, 16))
    rng = np.random.default_rng()
    lengths = np.array([10, 31])
    q, k, v, table, _ = paged_inputs(rng, layout, lengths + 16, 16, jnp.float32)
    plan = build_decode_schedule(lengths, layout, 16, 3, headroom_pages=1, min_chunk_tokens=16)
    for grown in (lengths, lengths + 6):
        assert plan.covers(grown)
        lens = jnp.asarray(grown, jnp.int32)
        out = paged_decode(q, k, v, table, lens, plan.schedule.layer(0), layout, interpret=True)
        assert rel_err(out, reference(q, k, v, table, lens, layout)) < 1e-4


def test_attention_seam_with_a_length_blind_schedule():
    """attention.decode inside jit: the new token's K/V written at length - 1, then the kernel with the trace-time
    schedule planned at the table's full width; the same out and pages as the reference backend."""
    layout = HeadLayout(4, 2, 32, (32, 16), (16, 32))
    rng = np.random.default_rng()
    q, k_pages, v_pages, table, lens = paged_inputs(rng, layout, [5, 40], 16, jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((2, layout.k_cols)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((2, layout.v_cols)), jnp.float32)
    schedule = static_decode_schedule(2, table.shape[1], layout, 16, 4)
    outs = {}
    for backend in ("interpret", "reference"):
        step = jax.jit(lambda *a, b=backend: attention.decode(*a, backend=b, schedule=schedule), static_argnums=3)
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
    plan = build_decode_schedule(lengths, layout, 32, headroom_pages=1)
    out = paged_decode(q, k, v, table, lens, plan.schedule.layer(0), layout)
    assert rel_err(out, reference(q, k, v, table, lens, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)

