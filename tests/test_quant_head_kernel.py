"""``ops.decode.quant_head_kernel``: decode over quantized per-head pages in interpret mode against
``quant_head_paging.decode_attention``, on pools of stale bytes, ragged per-head counts and partial groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops import quant_head_paging as qhp
from kvjax.ops.decode.head_kernel import live_work, work_items
from kvjax.ops.decode.quant_head_kernel import launch_heads, quant_head_decode
from kvjax.ops.decode.quant_kernel import _update, empty_carry, finish
from kvjax.ops.pallas_util import MASK

# widths that differ by head, two heads sharing a pair; K of 16 at 4 bits and of 16 or 48 at 2 bits read gathered
LAYOUT = HeadLayout(8, 4, 64, (16, 64, 16, 48), (32, 16, 32, 64))
REFERENCE = jax.jit(qhp.decode_attention, static_argnums=(5, 6, 7, 8, 9))
# a model's width pairs (the engine's ``pairs``): LAYOUT's and others; they name the kernel's classes
MODEL_PAIRS = ((16, 16), (16, 32), (32, 16), (48, 64), (64, 16), (64, 32))


def _state(rng, layout, b, group, bits, counts, pages_each=6):
    """A pool of random (never zero) bytes with each (row, head)'s ``counts`` slots written as random groups on
    shuffled pages, and a random tail: (pool, tail, tables, stored)."""
    page_bytes = qhp.pool_page_bytes([layout], group, bits)
    hkv = layout.num_kv_heads
    num_pages = 1 + b * hkv * pages_each
    pool = rng.integers(0, 256, (num_pages, page_bytes)).astype(np.uint8)
    tables = (1 + rng.permutation(b * hkv * pages_each)).reshape(b, hkv, pages_each).astype(np.int32)
    for row in range(b):
        for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
            fmt = qhp.head_format(kw, vw, group, bits)
            per = qhp.groups_per_page(page_bytes, kw, vw, group, bits)
            full = int(counts[row, h]) // group
            assert full <= per * pages_each
            if not full:
                continue
            k = rng.normal(size=(full, group, kw)).astype(np.float32) * 2
            v = rng.normal(size=(full, group, vw)).astype(np.float32)
            encoded = np.asarray(fmt.encode(jnp.asarray(k), jnp.asarray(v)))
            for grp in range(full):
                page, nth = tables[row, h, grp // per], grp % per
                pool[page, nth * fmt.page_bytes : (nth + 1) * fmt.page_bytes] = encoded[grp]
    tail = rng.normal(size=(b + 1, group, layout.k_cols + layout.v_cols)).astype(np.float32)
    return page_bytes, jnp.asarray(pool), jnp.asarray(tail), jnp.asarray(tables), jnp.asarray(counts, jnp.int32)


def _check(layout, b, group, bits, counts, seed, first=None, **kw):
    rng = np.random.default_rng(seed)
    page_bytes, pool, tail, tables, stored = _state(rng, layout, b, group, bits, counts)
    q = jnp.asarray(rng.normal(size=(b, layout.q_cols)), jnp.float32)
    tokens = int(stored.max())
    want = REFERENCE(q, pool, tail, tables, stored, layout, page_bytes, group, bits, max(tokens, 1), first)
    got = quant_head_decode(q, pool, tail, tables, stored, layout, page_bytes, group, bits, first=first,
                            interpret=True, **kw)  # fmt: skip
    live = np.repeat(np.asarray(stored) > 0, [layout.group_size * w for w in layout.v_widths], axis=1)
    assert np.isfinite(np.asarray(got)[live]).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    return got


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_ragged_heads_of_quantized_groups_and_exact_tails_equal_the_reference(bits, splits):
    """Every head a different count: none, less than a group (tail only), whole groups only, groups and a tail,
    several pages of groups; splits from the live schedule's choice to one and three (a split with no group)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, group = 3, 16
    counts = rng.integers(1, 5 * group, (b, 4))
    counts[0] = [0, 5, 3 * group, 3 * group + 7]  # an odd number of groups on a page of two: the second half-empty
    counts[1, 2] = 4 * group
    # three splits: a group a loop step (not the default), and a launch a class of the model's
    step = {3: dict(step_groups=1, pairs=MODEL_PAIRS, launches="class")}.get(splits, {})
    _check(LAYOUT, b, group, bits, counts, seed, splits=splits, **step)


@pytest.mark.parametrize("group", [8, 12])
def test_groups_narrower_than_a_tile_and_of_no_power_of_two(group):
    """A group of 8 slots (a chunk's rows masked to half its tile) and of 12 (no power of two): the group's bytes
    at their place in the page and the tail's rows as many as the group."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6 * group, (2, 4))
    _check(LAYOUT, 2, group, 4, counts, seed)


@pytest.mark.parametrize("pairs,launches", [(None, "layer"), (MODEL_PAIRS, "class"), (MODEL_PAIRS, "k-class")])
def test_a_sliding_window_skips_the_groups_before_its_first_slot(pairs, launches):
    """``first``: each head's first seen slot, inside a group, on a group's edge, past every full group (only the
    tail seen), or 0."""
    seed = fresh_seed()
    layout = HeadLayout(8, 4, 64, LAYOUT.k_widths, LAYOUT.v_widths, sliding_window=40)
    group = 16
    counts = np.array([[50, 70, 33, 20], [64, 3, 90, 47]])
    first = jnp.asarray([[10, 32, 32, 0], [50, 0, 60, 7]], jnp.int32)
    _check(layout, 2, group, 4, counts, seed, first=first, pairs=pairs, launches=launches)


@pytest.mark.parametrize("launches", ["layer", "class", "k-class"])
def test_a_step_wide_work_list_serves_the_layer(launches):
    """The engine builds ``live_work`` once a step from its live slots, one a head count ``launch_heads`` names:
    rows that store nothing in this layer still hold work items, which give zeros; a count missing is refused."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 60, (3, 4))
    counts[2] = 0
    sizes = launch_heads(LAYOUT, 4, launches)
    # LAYOUT's classes: (16, 32)'s twice, (64, 16)'s, (48, 64)'s; the last two of one K class (planes of 32)
    assert sizes == {"layer": (4,), "class": (1, 2), "k-class": (2,)}[launches]
    work = {n: live_work(jnp.ones((3, n), bool)) for n in sizes}
    got = _check(LAYOUT, 3, 16, 4, counts, seed, work=work, pairs=MODEL_PAIRS, launches=launches)
    assert not np.asarray(got)[2].any()
    with pytest.raises(ValueError, match="this launch needs"):
        _check(LAYOUT, 3, 16, 4, counts, seed, work={n + 4: w for n, w in work.items()}, launches=launches)


def test_each_launch_gets_programs_for_its_own_rows():
    """A launch a class (a launch a width pair before it) chooses its splits from its own (sequence, head) rows, not
    the layer's: at B32 a class of one head of 8 gets 16 splits (512 working programs), not the layer's 2 (64 of
    them working), so every launch fills an H100's 132 SMs (bench/results/eviction.md "Eviction on quantized pages:
    the engine's step through a kernel a width pair (H100)")."""
    layer = np.asarray(live_work(jnp.ones((32, 8), bool)))
    for n, splits in ((1, 16), (2, 8), (3, 4), (8, 2)):
        own = np.asarray(live_work(jnp.ones((32, n), bool)))
        assert own[:2].tolist() == [32 * n, splits] and own[0] * own[1] <= work_items(32 * n)
        assert own[0] * own[1] >= 256  # a launch of about TARGET_PROGRAMS working programs
    assert layer[1] == 2


def test_deferred_sums_equal_the_sums_reduced_every_step():
    """``quant_kernel._update`` with a deferred carry (the per-head kernel's: the softmax sums and the values' row
    terms kept [rows, tokens] to the loop's end) gives what reducing them every step gives, over steps of several
    chunks with row terms, a step whose maximum rises, masked tokens, and a final chunk without row terms (a tail's)."""
    rng = np.random.default_rng(seed := fresh_seed())
    rows, tokens, width = 16, 32, 48
    piece = type("Piece", (), {"tile": width})()

    def part(shift, with_rows=True):
        s = jnp.asarray(rng.normal(size=(rows, tokens)) + shift, jnp.float32)
        s = jnp.where(jnp.asarray(rng.random((1, tokens)) < 0.2), MASK, s)
        v = jnp.asarray(rng.normal(size=(tokens, width)), jnp.float32)
        zero = jnp.asarray(rng.normal(size=(tokens,)), jnp.float32)
        return s, lambda p: ([p @ v], p * zero[None, :] if with_rows else None)

    steps = [[part(0.0), part(1.0)], [part(4.0)], [part(-2.0), part(3.0)], [part(5.0, with_rows=False)]]
    results = {}
    for deferred in (True, False):
        carry = empty_carry([piece], tokens if deferred else None)
        for parts in steps:
            carry = _update(carry, parts)
        results[deferred] = finish(carry)
    for a, b in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


def test_bad_inputs_are_refused_in_one_line():
    rng = np.random.default_rng(fresh_seed())
    page_bytes, pool, tail, tables, stored = _state(rng, LAYOUT, 2, 16, 4, np.full((2, 4), 20))
    q = jnp.ones((2, LAYOUT.q_cols), jnp.float32)
    args = (LAYOUT, page_bytes, 16, 4)
    with pytest.raises(ValueError, match="pool must be uint8"):
        quant_head_decode(q, pool.astype(jnp.int8), tail, tables, stored, *args, interpret=True)
    with pytest.raises(ValueError, match="tail must be"):
        quant_head_decode(q, pool, tail[:, :8], tables, stored, *args, interpret=True)
    with pytest.raises(ValueError, match="is for sliding-window layers only"):
        quant_head_decode(q, pool, tail, tables, stored, *args, first=stored, interpret=True)
    with pytest.raises(ValueError, match="bits"):
        quant_head_decode(q, pool, tail, tables, stored, LAYOUT, page_bytes, 16, 3, interpret=True)
    with pytest.raises(ValueError, match="launches must be one of"):
        quant_head_decode(q, pool, tail, tables, stored, *args, launches="pair", interpret=True)
    with pytest.raises(ValueError, match="launches must be one of"):
        launch_heads(LAYOUT, 4, "pair")
    with pytest.raises(ValueError, match="merge must be one of"):
        quant_head_decode(q, pool, tail, tables, stored, *args, merge="numpy", interpret=True)
    with pytest.raises(ValueError, match="map a head count"):  # one list cannot serve a launch a class
        quant_head_decode(
            q, pool, tail, tables, stored, *args, launches="class", work=live_work(stored), interpret=True
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bits,pairs,launches",
    [(4, None, "layer"), (2, None, "layer"), (4, MODEL_PAIRS, "class"), (4, MODEL_PAIRS, "k-class")],
)
def test_on_the_gpu_bf16_queries_and_tail_match_the_float32_reference(bits, pairs, launches):
    """The Triton lowering on the GPU: bf16 q and tail (the engine's), several pages a head and splits from the live
    schedule, against the float32 reference (at ``highest``: XLA rounds float32 matmuls to TF32 on a GPU)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, group = 4, 16
    counts = rng.integers(1, 12 * group, (b, 4))
    page_bytes, pool, tail, tables, stored = _state(rng, LAYOUT, b, group, bits, counts, pages_each=12)
    q = jnp.asarray(rng.normal(size=(b, LAYOUT.q_cols)), jnp.float32)
    got = quant_head_decode(q.astype(jnp.bfloat16), pool, tail.astype(jnp.bfloat16), tables, stored, LAYOUT,
                            page_bytes, group, bits, pairs=pairs, launches=launches)  # fmt: skip
    with jax.default_matmul_precision("highest"):
        tail16 = tail.astype(jnp.bfloat16).astype(jnp.float32)
        q16 = q.astype(jnp.bfloat16).astype(jnp.float32)
        want = REFERENCE(q16, pool, tail16, tables, stored, LAYOUT, page_bytes, group, bits, int(stored.max()), None)
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 2e-2, f"seed {seed}: relative error {err}"


def test_the_kernel_lowers_for_sm90_one_launch_a_branch_a_class():
    """Lowered to Triton IR for an H100 (no GPU here): one launch, a branch per class of heads (LAYOUT's three),
    each with its dots (key planes, value planes and the tail's)."""
    from kvjax.ops.lowering import triton_modules

    rng = np.random.default_rng(fresh_seed())
    page_bytes, pool, tail, tables, stored = _state(rng, LAYOUT, 2, 16, 4, np.full((2, 4), 20))
    q = jnp.ones((2, LAYOUT.q_cols), jnp.bfloat16)

    def run(q, pool, tail, tables, stored):
        return quant_head_decode(
            q, pool, tail.astype(jnp.bfloat16), tables, stored, LAYOUT, page_bytes, 16, 4, launches="layer"
        )

    module, merged = triton_modules(run, (q, pool, tail, tables, stored))
    assert "@kvjax_quant_head_decode_int4" in module and module.count("tt.dot") >= 3 * 6
    assert "@kvjax_head_merge" in merged  # the items merged by a kernel (``item_merge``)


def test_extra_width_pairs_in_any_order_change_no_output_and_a_missing_one_is_refused():
    """``pairs`` (the engine's every layer's pairs, one kernel module for the model): branches for pairs the layer
    lacks, given before its own, leave the result equal to the reference; a pair of the layout left out is refused."""
    seed = fresh_seed()
    counts = np.random.default_rng(seed).integers(1, 60, (3, 4))
    pairs = ((32, 16), (64, 16), (16, 16), (48, 64), (16, 32))
    _check(LAYOUT, 3, 16, 4, counts, seed, pairs=pairs)
    rng = np.random.default_rng(seed)
    page_bytes, pool, tail, tables, stored = _state(rng, LAYOUT, 2, 16, 4, np.full((2, 4), 20))
    with pytest.raises(ValueError, match=r"\[\(16, 32\)\] missing"):
        quant_head_decode(jnp.ones((2, LAYOUT.q_cols)), pool, tail, tables, stored, LAYOUT, page_bytes, 16, 4,
                          pairs=pairs[:-1], interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="pairs must be distinct"):
        quant_head_decode(jnp.ones((2, LAYOUT.q_cols)), pool, tail, tables, stored, LAYOUT, page_bytes, 16, 4,
                          pairs=pairs + pairs[:1], interpret=True)  # fmt: skip


@pytest.mark.parametrize("launches", ["layer", "class", "k-class"])
def test_the_kernel_lowers_to_the_same_triton_modules_whatever_the_layer(launches):
    """Given the model's pairs, two layers of other widths lower (for an H100; no GPU here) to the same Triton modules:
    one a layer switching between the model's classes, or one a class the layer has (``launches``), then the merge.
    XLA keys its kernel cache by the module, so a model compiles each once (a branch a width pair in one launch made
    a module a layer; bench/notes/2026-12-06-quant-head-compile.md)."""
    from kvjax.ops.decode.quant_head_kernel import head_class
    from kvjax.ops.lowering import triton_modules
    from kvjax.ops.pallas_util import width_pairs

    other = HeadLayout(8, 4, 64, (32, 64, 64, 16), (48, 16, 32, 32))  # shares (64, 16) and (16, 32) with LAYOUT
    pairs = tuple(sorted({p for lay in (LAYOUT, other) for p, _ in width_pairs(lay)}))
    page_bytes = qhp.pool_page_bytes([LAYOUT, other], 16, 4)
    modules = {}
    for lay in (LAYOUT, other):
        args = (
            jax.ShapeDtypeStruct((2, lay.q_cols), jnp.bfloat16),
            jax.ShapeDtypeStruct((17, page_bytes), jnp.uint8),
            jax.ShapeDtypeStruct((2, 16, lay.k_cols + lay.v_cols), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 4, 2), jnp.int32),
            jax.ShapeDtypeStruct((2, 4), jnp.int32),
        )

        def run(q, pool, tail, tables, stored, lay=lay):
            return quant_head_decode(
                q, pool, tail, tables, stored, lay, page_bytes, 16, 4, pairs=pairs, launches=launches
            )

        classes = sorted({head_class(kw, vw, 4) for kw, vw in zip(lay.k_widths, lay.v_widths)})
        *got, merged = triton_modules(run, args)
        assert modules.setdefault("merge", merged) == merged and "@kvjax_head_merge" in merged
        keys = {"layer": ["layer"], "class": classes, "k-class": list(dict.fromkeys(c[0] for c in classes))}[launches]
        assert len(got) == len(keys)
        for module, key in zip(got, keys):
            assert modules.setdefault(key, module) == module, f"{key}: another module in another layer"
            assert "@kvjax_quant_head_decode_int4" in module
    model_classes = {head_class(kw, vw, 4) for kw, vw in pairs}
    launches_of = {"layer": 1, "class": len(model_classes), "k-class": len({c[0] for c in model_classes})}
    assert len(modules) == 1 + launches_of[launches] == len(set(modules.values()))
