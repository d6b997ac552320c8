"""Banded ZACK (``compress(band=W)``): keys stored in the frame of their band of W positions, read back turned by the
band's start angle (DESIGN.md section 7, "Banded bases"). At full width the model is the uncompressed one at every
position, across band edges; the rebuild, the decode kernel reading queries a band, Palu's kernel with a band and
the engine agree with the references; the
plan records its band, and bad requests are refused before any work."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed, latent_case, varied_plan_model

import kvjax
from kvjax.compression import RankPlan, calibrate, calibration_tokens, make_plan
from kvjax.compression.plan import BANDED_KV_BITS
from kvjax.layout import HeadLayout
from kvjax.models.latent import LatentK
from kvjax.models.rope import apply_rope, inverse_frequencies
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.decode.schedule import FIRST_PAGE
from kvjax.ops.palu import palu_decode
from kvjax.runtime.engine import Engine

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
CALIBRATION = dict(calibration="random", num_tokens=256, seq_len=64, progress=False)


@pytest.mark.parametrize("band", [1, 4, 16])
def test_full_width_banded_model_is_the_uncompressed_model_at_every_position(band):
    """Removal rate 0 keeps every direction: the band frames are orthogonal changes of basis, so the logits are the
    uncompressed model's (float32) at positions inside bands and across their edges, on a prompt longer than
    several bands."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    full = kvjax.compress(model, removal_rate=0.0, band=band, seed=seed % 1000, **CALIBRATION)
    assert full.plan.band == band and full.plan.max_context is None and full.plan.rate == 0.0
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=(2, 3 * band + 21))
    want = np.asarray(model.logits(tokens))
    error, peak = np.abs(np.asarray(full.logits(tokens)) - want), np.abs(want).max()
    # float32 rounding through the frames: over 25 seeds the worst logit is 0.3-1.2e-4 of the peak and the RMS about
    # 4e-6 of it; a wrong angle or basis moves logits by a large share of the peak
    assert error.max() <= 3e-4 * peak and np.sqrt(np.mean(error**2)) <= 2e-5 * peak, (
        f"seed {seed}: max {error.max() / peak:.2e}, RMS {np.sqrt(np.mean(error**2)) / peak:.2e} of the peak"
    )


@pytest.mark.parametrize("band", [None, 1, 8, 32])
def test_the_rebuild_turns_each_key_by_its_bands_start(band):
    """``LatentK`` with a band: head g's latent times ``up[g]``, rotated by RoPE at ``n - n mod band`` (at ``n``
    without a band), token by token in float64."""
    rng = np.random.default_rng(fresh_seed())
    layout = HeadLayout(4, 2, 16, (16, 8 * 2), (16, 16))
    inv_freq = inverse_frequencies(16, 10000.0, {})
    up = tuple(rng.standard_normal((w, 16)) for w in layout.k_widths)
    latent = rng.standard_normal((1, 70, layout.k_cols))
    positions = np.arange(70)[None] + 5
    got = np.asarray(LatentK(tuple(map(jnp.asarray, up)), inv_freq, layout, band)(latent, positions))
    at = positions if band is None else positions - positions % band
    full = np.stack([latent[..., :16] @ up[0], latent[..., 16:] @ up[1]], axis=2)
    want = np.asarray(apply_rope(jnp.asarray(full, jnp.float32), jnp.asarray(at), inv_freq)).reshape(1, 70, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("band, step", [(4, 16), (16, 16), (64, 16), (16, 32)])
def test_palus_kernel_with_a_band_matches_the_reference(band, step):
    """Palu's decode kernel serves banded keys (interpret mode): bands narrower than, equal to and wider than its
    step, against ``paged_decode_attention`` with the same rebuild."""
    seed = fresh_seed()
    layout = HeadLayout(8, 2, 64, (48, 16), (16, 64))
    q, k, v, table, lengths, rebuild = latent_case(np.random.default_rng(seed), layout, [1, 37, 130], 16, band=band)
    out = palu_decode(
        q, k, v, table, lengths, rebuild.up, rebuild.inv_freq, layout, splits=2, step=step, band=band, interpret=True
    )
    ref = paged_decode_attention(q, k, v, table, lengths, layout, rebuild)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4, err_msg=f"seed {seed}")
    plain = paged_decode_attention(q, k, v, table, lengths, layout, dataclasses.replace(rebuild, band=None))
    assert np.abs(np.asarray(plain) - np.asarray(ref)).max() > 1e-3  # the band changes what is read


@pytest.mark.parametrize("band, kernel", [(4, "Palu's decode kernel"), (16, "decode projects each query once a band")])
def test_banded_on_the_kernels_gives_the_reference_tokens_with_chunked_prompts_and_a_window(band, kernel):
    """The engine serves a banded model on the kernels (interpret mode): bands under ``MIN_BAND`` on Palu's decode
    kernel, wider ones on the variable-width kernel reading queries a band; prompts longer than a chunk, so later
    chunks read a prefix across band edges; Mistral's sliding window; the reference path's greedy tokens."""
    cfg = dataclasses.replace(TINY_CONFIGS["mistral"], head_dim=64, hidden_size=128, sliding_window=40)
    model = varied_plan_model(kvjax.Model.random(cfg, seed=fresh_seed() % 1000, scale=5.0), band=band)
    assert model.module.rebuilt_k
    prompts = [np.random.default_rng().integers(0, 97, n).tolist() for n in (70, 33, 5)]
    settings = dict(max_new_tokens=8, max_batch=4, page_size=16, chunk_tokens=32)
    ref = kvjax.generate(model, prompts, backend="reference", **settings)
    ker = kvjax.generate(model, prompts, backend="interpret", **settings)
    assert [r.tokens for r in ker] == [r.tokens for r in ref]
    line = Engine(model, max_batch=2, max_seq_len=64, backend="interpret").describe()
    assert f"keys in bands of {band} positions" in line and kernel in line, line


@pytest.mark.parametrize("band, backend", [(4, "reference"), (16, "interpret")])
def test_a_preempted_banded_request_is_recomputed_to_the_same_tokens(band, backend):
    """A cache with room for about two of five sequences (prompts in chunks of 16 tokens): requests are preempted
    and their prompt and tokens so far recomputed, so their keys are written again in their bands' frames (prefill
    across band edges, then decode); every request still gets the tokens it gets with room for all (reference path,
    and the interpret-mode kernels)."""
    from kvjax.runtime.cache import bytes_per_token

    seed = fresh_seed()
    model = varied_plan_model(kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0), band=band)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(9, 40, 5)]
    settings = dict(max_new_tokens=14, max_batch=5, max_seq_len=64, page_size=4, chunk_tokens=16, backend=backend)
    want = [g.tokens for g in kvjax.generate(model, prompts, **settings)]
    engine = Engine(model, max_batch=5, max_seq_len=64, page_size=4, chunk_tokens=16, backend=backend)
    budget = engine.activation_bytes() + 21 * 4 * bytes_per_token(model.layouts, model.dtype)  # 20 usable pages
    stats: dict = {}
    got = [g.tokens for g in kvjax.generate(model, prompts, cache_memory=budget, stats=stats, **settings)]
    assert stats["preemptions"] > 0, f"seed {seed}"
    assert got == want, f"seed {seed}"


BAND_LAYOUTS = [HeadLayout(8, 2, 64, (48, 16), (16, 64)), HeadLayout(8, 4, 64, (16, 32, 64, 16), (64, 16, 32, 48))]


@pytest.mark.parametrize("band", [16, 32, 64])
@pytest.mark.parametrize("layout", BAND_LAYOUTS, ids=["two-heads", "four-heads"])
def test_the_decode_kernel_reading_queries_a_band_matches_the_reference(band, layout):
    """``DecodeOp(band=)`` (interpret mode) against ``paged_decode_attention`` with the banded rebuild: sequences
    shorter than a band and across several, cut by the schedule at pages that are not multiples of a step (its first
    step then masks the tokens before it), runs of several heads, folded rows (each fold its own band's queries)
    and chunks wider than a band (a band's queries each); band queries made three sequences a program
    (``DecodeConfig.band_seqs``), at band 16 a sequence of 69 bands whose two blocks one program makes
    (``band_blocks``)."""
    seed = fresh_seed()
    lengths = [1, 37, 1100 if band == 16 else 300, 130]
    q, k, v, table, lengths, rebuild = latent_case(np.random.default_rng(seed), layout, lengths, 8, band=band)
    # long sequences cut in several items
    config = dataclasses.replace(DECODE, min_chunk_tokens=16, band_blocks=2 if band == 16 else 1, band_seqs=3)
    op = DecodeOp([layout], 8, table.shape[1], max_batch=4, config=config, band=band, num_programs=5, interpret=True)
    schedule = op.schedule(np.asarray(lengths))
    first = np.asarray(schedule.items)[..., FIRST_PAGE].ravel() * 8
    assert (first % 64).any()
    out = op.run(q, k, v, table, lengths, schedule.layer(0), layout, rebuild)
    ref = paged_decode_attention(q, k, v, table, lengths, layout, rebuild)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("band", [16, 64])
@pytest.mark.parametrize("form", ["kernel", "reference"])
def test_every_bands_queries_are_the_query_turned_back_and_projected(band, form):
    """``bands.band_queries`` (interpret mode) and its XLA reference, row b * B + s: sequence s's whole heads turned
    back by band b's start angle (RoPE(-bW)) and projected on their group's packed columns, as
    ``QKRotation.packed`` projects them."""
    from kvjax.models.rotation import QKRotation
    from kvjax.ops.decode.bands import band_queries, band_queries_reference

    rng = np.random.default_rng(fresh_seed())
    layout = BAND_LAYOUTS[1]
    d, batch, bands = layout.head_dim, 3, 5
    q = jnp.asarray(rng.standard_normal((batch, layout.num_heads * d)), jnp.float32)
    basis = jnp.asarray(rng.standard_normal((d, layout.k_cols)), jnp.float32)
    inv_freq = inverse_frequencies(d, 10000.0, {})
    if form == "kernel":
        got = band_queries(q, basis, inv_freq, band, layout, bands, interpret=True)
    else:
        got = band_queries_reference(q, basis, inv_freq, band, layout, bands)
    got = np.asarray(got).reshape(bands, batch, layout.q_cols)
    rotation = QKRotation(basis, layout)
    for b in range(bands):
        at = jnp.full((batch, 1), -b * band)
        turned = apply_rope(q.reshape(batch, 1, layout.num_heads, d), at, inv_freq).reshape(batch, -1)
        with jax.default_matmul_precision("highest"):
            want, _ = rotation.packed(turned, jnp.zeros((batch, layout.num_kv_heads * d)))
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("piece, blocks, seqs", [(None, 1, 1), (16, 1, 1), (None, 2, 1), (16, 3, 2), (None, 2, 3)])
@pytest.mark.parametrize("layout", BAND_LAYOUTS, ids=["two-heads", "four-heads"])
def test_the_band_query_kernel_makes_the_bands_each_sequence_reaches(layout, piece, blocks, seqs):
    """``band_queries`` (interpret mode, scaled, lengths given; basis columns in one tile or in pieces, those past a
    head's width skipped; one block of bands a program or several in turn; one sequence a program or several, the
    last program's past the batch) equals the XLA reference on every band a sequence reaches (b * W < length),
    across more than one block of bands and with a block past the last band."""
    from kvjax.ops.decode.bands import BAND_BLOCK, band_queries, band_queries_reference

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    d, band, bands = layout.head_dim, 16, BAND_BLOCK + 7
    lengths = np.asarray([1, 16, 17, bands * band, 40 * band + 3])
    q = jnp.asarray(rng.standard_normal((len(lengths), layout.num_heads * d)), jnp.float32)
    basis = jnp.asarray(rng.standard_normal((d, layout.k_cols)), jnp.float32)
    inv_freq = inverse_frequencies(d, 10000.0, {})
    args = (q, basis, inv_freq, band, layout, bands, 0.7)
    got = band_queries(
        *args,
        lengths=jnp.asarray(lengths),
        piece=piece,
        blocks=blocks,
        seqs=seqs,
        block=16 if blocks > 1 else BAND_BLOCK,
        interpret=True,
    )
    got = np.asarray(got).reshape(bands, len(lengths), -1)
    want = np.asarray(band_queries_reference(*args)).reshape(bands, len(lengths), -1)
    reached = np.arange(bands)[:, None] * band < lengths[None, :]
    np.testing.assert_allclose(got[reached], want[reached], rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("tokens", [1, 7, 600])
def test_keys_are_each_heads_key_on_its_own_directions_in_either_form(tokens):
    """``QKRotation.keys``: one GEMM of every head on every column (a decode step's few tokens) or a product a group
    (past ``ONE_GEMM_ROWS``), either way head g's key times its own columns, as float64 computes it."""
    from kvjax.models.rotation import ONE_GEMM_ROWS, QKRotation

    rng = np.random.default_rng(fresh_seed())
    layout = BAND_LAYOUTS[1]
    d = layout.head_dim
    matrix = rng.standard_normal((d, layout.k_cols))
    k = rng.standard_normal((1, tokens, layout.num_kv_heads * d))
    with jax.default_matmul_precision("highest"):
        got = np.asarray(QKRotation(jnp.asarray(matrix, jnp.float32), layout).keys(jnp.asarray(k, jnp.float32)))
    starts = HeadLayout.offsets(layout.k_widths)
    kh = k.reshape(1, tokens, layout.num_kv_heads, d)
    want = np.concatenate(
        [kh[..., g, :] @ matrix[:, s : s + w] for g, (s, w) in enumerate(zip(starts, layout.k_widths))], -1
    )
    assert (tokens <= ONE_GEMM_ROWS) == (tokens < 600)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_band_query_kernel_refuses_knobs_it_cannot_tile():
    from kvjax.ops.decode.bands import band_queries

    layout = BAND_LAYOUTS[0]
    q, basis = jnp.ones((1, layout.num_heads * 64)), jnp.ones((64, layout.k_cols))
    for knobs in (dict(block=48), dict(piece=8)):
        with pytest.raises(ValueError, match="block and piece must be powers of two >= 16"):
            band_queries(q, basis, inverse_frequencies(64, 1e4, {}), 16, layout, 4, interpret=True, **knobs)
    for name, value in itertools.product(("blocks", "seqs"), (0, -1, 1.5, True, "2")):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
            band_queries(q, basis, inverse_frequencies(64, 1e4, {}), 16, layout, 4, interpret=True, **{name: value})


def test_a_banded_decode_op_refuses_keys_of_another_band():
    layout = BAND_LAYOUTS[0]
    q, k, v, table, lengths, rebuild = latent_case(np.random.default_rng(0), layout, [20], 16, band=32)
    op = DecodeOp([layout], 16, table.shape[1], band=16, interpret=True)
    schedule = op.schedule(np.asarray(lengths)).layer(0)
    for wrong in (rebuild, None):
        with pytest.raises(ValueError, match="reads keys in bands of 16; pass the layer's banded rebuild"):
            op.run(q, k, v, table, lengths, schedule, layout, wrong)
    with pytest.raises(ValueError, match="band must be a power of two >= 16"):
        paged_decode(q, k, v, table, lengths, schedule, layout, basis=jnp.ones((64, 64)), inv_freq=np.ones(32), band=8)
    for bad, error, match in [
        (8, ValueError, "band must be a power of two >= 16, got 8"),
        (24, ValueError, "band must be a power of two >= 16, got 24"),
        (-16, ValueError, "band must be a power of two >= 16, got -16"),
        (float("nan"), TypeError, "band must be an integer"),
        ("16", TypeError, "band must be an integer"),
    ]:
        with pytest.raises(error, match=match):
            DecodeOp([layout], 16, table.shape[1], band=bad)


def test_a_banded_plan_is_recorded_saved_and_loaded(tmp_path):
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    banded = kvjax.compress(model, target_rate=0.5, band=32, seed=seed % 1000, **CALIBRATION)
    assert banded.plan.band == 32 and banded.plan.max_context is None and banded.plan.rate >= 0.5
    assert "bands of 32 positions" in banded.plan.summary()
    banded.save(str(tmp_path / "ckpt"))
    back = kvjax.load(str(tmp_path / "ckpt"), dtype="float32")
    assert back.plan.band == 32 and back.plan.to_json() == banded.plan.to_json() and back.module.band == 32
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=(1, 40))
    np.testing.assert_allclose(back.logits(tokens), banded.logits(tokens), rtol=1e-5, atol=1e-5)
    old = json.loads(banded.plan.to_json())
    del old["band"]  # a plan written before the field existed
    assert RankPlan.from_json(json.dumps(old)).band is None


def test_bad_bands_are_refused_before_any_work():
    model = kvjax.Model.random(WIDE, seed=1)
    stats = calibrate(model, calibration_tokens(model, "random", 64, 32), progress=False)
    for band, error, match in [
        (3, ValueError, "band must be a power of two from 1 to 4096, got 3"),
        (0, ValueError, "band must be >= 1, got 0"),
        (8192, ValueError, "band must be a power of two from 1 to 4096, got 8192"),
        (16.0, TypeError, "band must be an integer"),
    ]:
        with pytest.raises(error, match=match):
            kvjax.compress(model, target_rate=0.5, band=band, **CALIBRATION)
    with pytest.raises(ValueError, match="band applies to method='zack'"):
        kvjax.compress(model, target_rate=0.5, method="palu", band=16, **CALIBRATION)
    with pytest.raises(ValueError, match="band serves every position: give max_context=None"):
        kvjax.compress(model, target_rate=0.5, band=16, max_context=128, **CALIBRATION)
    with pytest.raises(ValueError, match="band serves every position: give max_context=None"):
        make_plan(model, stats, target_rate=0.5, band=16, max_context=64)
    with pytest.raises(ValueError) as e:
        kvjax.compress(model, target_rate=0.5, band=16, kv_bits=4, **CALIBRATION)
    assert str(e.value) == BANDED_KV_BITS
    banded = kvjax.compress(model, target_rate=0.5, band=16, **CALIBRATION)
    with pytest.raises(ValueError) as e:
        kvjax.generate(banded, [[1, 2, 3]], max_new_tokens=2, kv_bits=4)
    assert str(e.value) == BANDED_KV_BITS


@pytest.mark.parametrize("band", [16, 64])
def test_the_banded_decode_kernel_lowers_for_sm90(band):
    """The band queries' kernel and the variable-width kernel reading them lower to Triton IR for an H100."""
    from kvjax.ops.lowering import triton_modules

    layout = BAND_LAYOUTS[1]
    q, k, v, table, lengths, rebuild = latent_case(
        np.random.default_rng(0), layout, [1, 37], 16, dtype=jnp.bfloat16, band=band
    )
    op = DecodeOp([layout], 16, table.shape[1], band=band)
    schedule = op.schedule(np.asarray(lengths)).layer(0)

    def run(q, k, v, table, lengths):
        return op.run(q, k, v, table, lengths, schedule, layout, rebuild)

    queries, decode, merge = triton_modules(run, (q, k, v, table, lengths))
    assert "@kvjax_band_queries" in queries and "tt.dot" in queries
    assert "@kvjax_paged_decode" in decode and "tt.dot" in decode
    assert "tt.dot" not in merge


@pytest.mark.parametrize("band", [4, 64])
def test_palus_kernel_with_a_band_lowers_for_sm90(band):
    """The banded form of Palu's kernel lowers to Triton IR for an H100 (no GPU here: what XLA would compile)."""
    from kvjax.ops.lowering import triton_modules

    layout = HeadLayout(8, 2, 64, (48, 16), (16, 64))
    q, k, v, table, lengths, rebuild = latent_case(np.random.default_rng(0), layout, [1, 37], 16, band=band)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    up = tuple(u.astype(jnp.bfloat16) for u in rebuild.up)

    def run(q, k, v, table, lengths):
        return palu_decode(q, k, v, table, lengths, up, rebuild.inv_freq, layout, band=band)

    modules = triton_modules(run, (q, k, v, table, lengths))
    assert len(modules) == 2 and all("tt.dot" in m for m in modules)


def test_the_band_query_knobs_parse_and_refuse_with_the_bad_spec_named():
    from bench.palu import query_knobs

    assert query_knobs("64:128:4,32:32:8:4,64:128:4:2:4") == [(64, 128, 4, 1, 1), (32, 32, 8, 4, 1), (64, 128, 4, 2, 4)]
    for bad in ("64:128", "64:128:4:2:1:1", "64:0:4", "64:x:4", "64:128:4:-2", "64:128:4:1:0"):
        with pytest.raises(ValueError, match=f"got '{bad}'"):
            query_knobs(bad)
