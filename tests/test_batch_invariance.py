"""The batch-invariant mode: a sequence's plan, kernel output and tokens depend on it alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pallas_decode import paged_inputs, reference, rel_err

import kvjax
from kvjax.layout import HeadLayout
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.schedule import END_PAGE, FIRST_PAGE, SEQ, SLOT, UNIT, fixed_chunk_schedule

LAYOUTS = [
    HeadLayout(8, 2, 64, (48, 16), (16, 64)),
    HeadLayout(3, 3, 32, (32, 16, 32), (16, 32, 32), sliding_window=20),
]


def items_of(plan, seq):
    """Sequence ``seq``'s items as (unit, first page, end page, slot position) per layer, in a canonical order."""
    s = plan.schedule
    out = []
    for layer in range(s.items.shape[0]):
        real = np.arange(s.items.shape[2]) < s.counts[layer][:, None]
        it = s.items[layer][real]
        it = it[it[:, SEQ] == seq]
        begin = {int(u): int(r[0]) for (q, u), r in zip(s.merge_dest[layer], s.merge_range[layer]) if q == seq}
        out.append(
            sorted((int(i[UNIT]), int(i[FIRST_PAGE]), int(i[END_PAGE]), int(i[SLOT]) - begin[i[UNIT]]) for i in it)
        )
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=12), st.integers(0, 1), st.integers(1, 9))
def test_a_sequences_fixed_chunk_plan_ignores_the_others(lengths, which, programs):
    lay = LAYOUTS[which]
    together = fixed_chunk_schedule(lengths, lay, 16, programs, chunk_pages=4, splits=16)
    alone = fixed_chunk_schedule(lengths[:1], lay, 16, programs, chunk_pages=4, splits=16)
    assert items_of(together, 0) == items_of(alone, 0)
    assert together.capacity[0] == alone.capacity[0] >= lengths[0]
    # every item goes through the merge, at slot position = its chunk index (under a window, past the first)
    s = together.schedule
    real = np.arange(s.items.shape[2]) < s.counts[0][:, None]
    it = s.items[0][real]
    assert np.all(it[:, SLOT] >= 0)
    for (q, u), (begin, n) in zip(s.merge_dest[0], s.merge_range[0]):
        mine = it[(it[:, SEQ] == q) & (it[:, UNIT] == u)]
        assert sorted(mine[:, SLOT] - begin) == list(range(n))
        assert np.all(np.diff(mine[np.argsort(mine[:, SLOT]), FIRST_PAGE]) == 4)


@pytest.mark.parametrize("which", [0, 1])
def test_the_kernel_on_a_fixed_chunk_plan_matches_the_reference_and_ignores_the_batch(which):
    lay, rng = LAYOUTS[which], np.random.default_rng(which + 40)
    lengths = [150, 37, 90, 1]
    q, k, v, table, lens = paged_inputs(rng, lay, lengths, 16, jnp.float32)

    def run(b):
        plan = fixed_chunk_schedule(lengths[:b], lay, 16, 3, chunk_pages=2, splits=8)
        return paged_decode(q[:b], k, v, table[:b], lens[:b], plan.schedule.layer(0), lay, interpret=True)

    out = run(4)
    assert rel_err(out, reference(q, k, v, table, lens, lay)) < 1e-5
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(run(1)[0]))


def test_a_plan_past_its_splits_is_refused():
    with pytest.raises(ValueError, match="more than splits"):
        fixed_chunk_schedule([1000], LAYOUTS[0], 16, 2, chunk_pages=2, splits=4)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_bf16_tokens_batched_equal_tokens_alone(backend):
    model = kvjax.Model.random(TINY_CONFIGS["llama"], dtype="bfloat16", seed=7, scale=4.0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(2, 60, 6 if backend == "reference" else 3)]
    opts = dict(max_new_tokens=6, max_batch=4, max_seq_len=96, batch_invariant=True, backend=backend)
    batched = [r.tokens for r in kvjax.generate(model, prompts, **opts)]
    assert batched == [kvjax.generate(model, [p], **opts)[0].tokens for p in prompts]
    assert [r.tokens for r in kvjax.generate(model, prompts[::-1], **opts)] == batched[::-1]


def test_invariant_sampling_depends_on_the_seed_not_the_batch():
    model = kvjax.Model.random(TINY_CONFIGS["mistral"], dtype="bfloat16", seed=2, scale=3.0)
    opts = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, max_seq_len=64, batch_invariant=True)
    alone = kvjax.generate(model, [[4, 5, 6]], seed=11, **opts)[0].tokens
    mixed = kvjax.generate(model, [[1, 2], [4, 5, 6], [9] * 20], seed=11, **opts)[1].tokens
    assert alone == mixed != kvjax.generate(model, [[4, 5, 6]], seed=12, **opts)[0].tokens
    assert jax.numpy.dtype(model.dtype) == jnp.bfloat16
