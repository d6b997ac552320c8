"""Palu's fused decode kernel (K rebuilt from its latent, RoPE and scores in one kernel) against the jnp reference
with the same ``LatentK``: interpret mode on the CPU, compiled on a GPU; and Palu through the engine's kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import latent_case

from kvjax.layout import HeadLayout
from kvjax.models.latent import LatentK
from kvjax.ops import attention
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.grouped import full_width
from kvjax.ops.palu import PaluDecodeOp, default_splits, live_splits, palu_decode
from kvjax.ops.prefill.op import PrefillOp

GPU = jax.default_backend() == "gpu"


def reference(q, k, v, table, lengths, layout, rebuild):
    def f32(x):
        return x.astype(jnp.float32)

    exact = LatentK(tuple(f32(u) for u in rebuild.up), rebuild.inv_freq, layout)
    with jax.default_matmul_precision("highest"):
        return paged_decode_attention(f32(q), f32(k), f32(v), table, lengths, layout, exact)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


CASES = {
    # name: (layout, lengths, page_size, dtype, splits, step)
    "G4 mixed widths f32 one split": (HeadLayout(8, 2, 64, (48, 16), (16, 64)), [1, 37, 130], 16, jnp.float32, 1, 32),
    "G2 mixed widths f32 four splits": (
        HeadLayout(8, 4, 64, (64, 32, 16, 48), (32, 64, 48, 16)),
        [5, 200, 97, 64],
        16,
        jnp.float32,
        4,
        32,
    ),
    "G4 bf16 pages of 8, step 16": (HeadLayout(8, 2, 128, (64, 96), (128, 32)), [300, 17], 8, jnp.bfloat16, 2, 16),
    "G1 window f32": (
        HeadLayout(4, 4, 32, (16, 32, 16, 16), (16, 16, 32, 16), sliding_window=40),
        [90, 3, 41, 160],
        16,
        jnp.float32,
        2,
        32,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_palu_decode_matches_reference(name):
    layout, lengths, page_size, dtype, splits, step = CASES[name]
    seed = np.random.SeedSequence().entropy
    q, k, v, table, lens, rebuild = latent_case(np.random.default_rng(seed), layout, lengths, page_size, dtype)
    up = rebuild.up
    out = palu_decode(q, k, v, table, lens, up, rebuild.inv_freq, layout, splits=splits, step=step, interpret=True)
    ref = reference(q, k, v, table, lens, layout, rebuild)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < (2e-2 if dtype == jnp.bfloat16 else 1e-5), f"seed {seed}"


def test_the_angle_carried_across_a_long_sequence_stays_exact():
    """The kernel turns each step's angle from the last step's (angle addition, no trig in its loop): over 4,100
    tokens (129 steps of one program) in float32 its output still matches the reference, which computes every
    position's angle afresh, at Llama 3's RoPE base."""
    seed = np.random.SeedSequence().entropy
    layout = HeadLayout(8, 2, 64, (48, 16), (16, 64))
    case = latent_case(np.random.default_rng(seed), layout, [4100, 2500], 16, jnp.float32, theta=500000.0)
    q, k, v, table, lens, rebuild = case
    out = palu_decode(q, k, v, table, lens, rebuild.up, rebuild.inv_freq, layout, splits=1, interpret=True)
    assert rel_err(out, reference(q, k, v, table, lens, layout, rebuild)) < 2e-5, f"seed {seed}"


def test_a_sequence_of_length_zero_gives_zeros_and_leaves_the_others():
    layout = HeadLayout(4, 2, 32, (16, 32), (32, 16))
    rng = np.random.default_rng()
    q, k, v, table, lens, rebuild = latent_case(rng, layout, [20, 50], 16, jnp.float32)
    up = rebuild.up
    both = palu_decode(q, k, v, table, lens, up, rebuild.inv_freq, layout, splits=2, interpret=True)
    empty = palu_decode(q, k, v, table, lens.at[0].set(0), up, rebuild.inv_freq, layout, splits=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(empty[0]), 0)
    np.testing.assert_array_equal(np.asarray(empty[1]), np.asarray(both[1]))


def test_splits_aim_at_a_thousand_programs():
    assert default_splits(32, 8) == 4 and default_splits(64, 8) == 2 and default_splits(8, 8) == 16
    assert default_splits(1024, 8) == 1


def test_attention_seams_run_palu_on_its_kernels():
    """attention.decode and attention.prefill (with and without a prefix) with Palu's ops equal the reference path
    and write the same latent pages."""
    layout = HeadLayout(8, 2, 64, (32, 48), (64, 16))
    rng = np.random.default_rng()
    q, k_pages, v_pages, table, _, rebuild = latent_case(rng, layout, [70, 40], 16, jnp.float32)
    ops = {"kernel": (PrefillOp([full_width(layout)], interpret=True), PaluDecodeOp(interpret=True))}
    ops["reference"] = (None, None)
    chunk = 24
    qc = jnp.asarray(rng.standard_normal((2, chunk, layout.num_heads * 64)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((2, chunk, layout.k_cols)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((2, chunk, layout.v_cols)), jnp.float32)
    lens = jnp.asarray([chunk, 17], jnp.int32)
    starts = jnp.asarray([32, 0], jnp.int32)
    got = {}
    with jax.default_matmul_precision("highest"):
        for name, (pre, dec) in ops.items():
            fresh, kp, vp = attention.prefill(
                qc, kc, vc, layout, k_pages, v_pages, table, lens, op=pre, rebuild=rebuild
            )
            later, kp, vp = attention.prefill(qc, kc, vc, layout, kp, vp, table, lens, starts, op=pre, rebuild=rebuild)
            step, kp, vp = attention.decode(
                qc[:, 0], kc[:, 0], vc[:, 0], layout, kp, vp, table, starts + lens + 1, op=dec, rebuild=rebuild
            )
            got[name] = fresh, later, step, kp, vp
    rows = np.arange(chunk)[None, :] < np.asarray(lens)[:, None]  # rows past a chunk's length are unspecified
    for i, (a, b) in enumerate(zip(got["kernel"], got["reference"])):
        a, b = (np.asarray(a)[rows], np.asarray(b)[rows]) if i < 2 else (a, b)
        assert rel_err(a, b) < 1e-5, i


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_palu_decode_on_gpu(dtype):
    layout = HeadLayout(32, 8, 128, (64, 32, 48, 128, 16, 80, 64, 96), (64, 96, 16, 128, 48, 64, 32, 80))
    lengths = [1, 700, 4000, 129, 2048, 33, 999, 3000]
    q, k, v, table, lens, rebuild = latent_case(np.random.default_rng(), layout, lengths, 16, dtype, theta=500000.0)
    up = rebuild.up
    out = palu_decode(q, k, v, table, lens, up, rebuild.inv_freq, layout, splits=4)
    assert rel_err(out, reference(q, k, v, table, lens, layout, rebuild)) < (2e-2 if dtype == jnp.bfloat16 else 1e-4)


@pytest.mark.parametrize("splits", [0, -2, 1.5])
def test_a_bad_split_count_is_refused(splits):
    with pytest.raises((ValueError, TypeError), match="splits"):
        PaluDecodeOp(splits=splits, interpret=True)


@pytest.mark.parametrize("band", [0, 24, 48])
def test_a_band_that_neither_divides_the_step_nor_is_a_multiple_of_it_is_refused(band):
    """The kernel's angles assume a step lies in one band or splits into whole bands (what a band's start is for a
    token of the step): a band of 24 or 48 against a step of 32 would turn tokens by the wrong band's angle."""
    layout = HeadLayout(8, 2, 64, (48, 16), (16, 64))
    q, k, v, table, lens, rebuild = latent_case(np.random.default_rng(), layout, [5, 40], 16, jnp.float32)
    with pytest.raises(ValueError, match="band"):
        palu_decode(q, k, v, table, lens, rebuild.up, rebuild.inv_freq, layout, step=32, band=band, interpret=True)


def test_live_rows_set_the_split_count():
    """A padded batch's empty rows do no work, so only the live rows count toward the programs the splits fill."""
    lengths = jnp.asarray([300, 0, 0, 0, 5, 0, 0, 0] * 8)  # 16 live rows of 64
    assert int(live_splits(lengths, 8, 16)) == default_splits(16, 8) == 8
    assert int(live_splits(lengths, 8, 4)) == 4  # never past the grid's splits
    assert int(live_splits(jnp.zeros(64, jnp.int32), 8, 16)) == 16
    assert int(live_splits(jnp.full(1024, 7), 8, 16)) == 1


@pytest.mark.parametrize("live", [1, 3])
def test_results_do_not_depend_on_the_split_count(live):
    """Live-row splitting changes only how a sequence's keys are cut, not the answer (float error only)."""
    layout = HeadLayout(4, 2, 32, (16, 32), (32, 16))
    rng = np.random.default_rng()
    q, k, v, table, lens, rebuild = latent_case(rng, layout, [90, 130, 40][:live], 16, jnp.float32)
    outs = [
        palu_decode(
            q, k, v, table, lens, rebuild.up, rebuild.inv_freq, layout, splits=s, target_programs=t, interpret=True
        )
        for s, t in ((1, None), (8, None), (8, 64))
    ]
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), rtol=1e-5, atol=1e-5)
