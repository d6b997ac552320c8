"""``ops.decode.sums_kernel.add_weights``: the decode step's softmax weights added into each stored slot's sum."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.ops.decode.sums_kernel import add_weights, add_weights_reference


def _case(rng, b, heads, group, cap):
    """Scores, each row's log2 denominator over the slots it sees, the seen range and prior sums (never zero)."""
    raw = rng.normal(size=(b, heads, group, cap)).astype(np.float32) * 3
    stored = rng.integers(0, cap + 1, (b, heads))
    stored[0, 0] = cap  # a head storing every slot the scores cover
    if b > 1:
        stored[1, 0] = 0  # a row adding nothing
    first = np.minimum(rng.integers(0, cap // 2, (b, heads)), np.maximum(stored - 1, 0))
    slot = np.arange(cap)
    seen = (slot >= first[..., None]) & (slot < stored[..., None])
    with np.errstate(divide="ignore"):
        lse = np.log2(np.where(seen[:, :, None], np.exp2(raw), 0.0).sum(-1)).astype(np.float32)
    return raw, lse, first, stored


@pytest.mark.parametrize(
    "group, cap, held, interpret",
    [
        (4, 40, 40, True),
        (3, 1500, 1500, True),  # a group short of a power of two; two tiles of slots
        (1, 33, 50, True),  # sums longer than the scores: their tail is untouched
        pytest.param(4, 5000, 5000, False, marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("square", [False, True])
def test_the_weights_a_head_sees_are_added_to_its_sums_and_nothing_else(group, cap, held, interpret, square):
    """Each (sequence, head) adds exp2(score - lse) over its group (squared first for KV-Compress) on the slots
    first <= s < stored, and only there; a row with stored 0 and slots past the scores keep their sums; equal to the
    jnp reference."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    raw, lse, first, stored = _case(rng, 3, 2, group, cap)
    sums = rng.uniform(0.5, 2.0, (3, 2, held)).astype(np.float32)
    args = tuple(jnp.asarray(x) for x in (raw, lse, first, stored, sums))
    got = np.asarray(add_weights(*args, square=square, interpret=interpret))
    np.testing.assert_allclose(got, add_weights_reference(*args, square=square), rtol=1e-5, err_msg=f"seed {seed}")
    slot = np.arange(held)
    seen = (slot >= first[..., None]) & (slot < np.minimum(stored, cap)[..., None])
    np.testing.assert_array_equal(got[~seen], sums[~seen])
    w = np.where(seen[..., :cap][:, :, None], np.exp2(raw - lse[..., None]), 0.0)
    rows = w.sum(-1)  # each row's weights over what it sees sum to 1
    np.testing.assert_allclose(rows[stored > first], 1.0, rtol=1e-5)
    want = sums.copy()
    want[..., :cap] += (w * w if square else w).sum(axis=2)
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"seed {seed}")


def test_mismatched_shapes_are_refused():
    raw = jnp.ones((2, 3, 4, 16))
    with pytest.raises(ValueError, match="do not match the scores"):
        add_weights(
            raw, jnp.ones((2, 3, 4)), jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3, 8))
        )


def test_the_sums_kernel_lowers_for_sm90():
    """Lowered to Triton IR for an H100 (no GPU here): one kernel, its sums aliased in place."""
    from kvjax.ops.lowering import triton_modules

    args = (jnp.ones((2, 3, 4, 64)), jnp.ones((2, 3, 4)), jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), jnp.int32))
    (module,) = triton_modules(lambda *a: add_weights(*a, square=True), (*args, jnp.ones((2, 3, 64))))
    assert "@kvjax_add_decode_weights" in module and "tt.store" in module
