"""bench/quant_lab.py's kernels (interpret mode) equal the quantized decode reference: each lab variant computes the
attention it is timed for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from bench import (
    harness,  # noqa: E402
    quant_lab,  # noqa: E402
)
from kvjax.ops.decode.reference import quantized_decode_attention  # noqa: E402
from kvjax.ops.quant import PageFormat  # noqa: E402
from kvjax.ops.quant_paging import create_tail  # noqa: E402


@pytest.mark.parametrize("variant", ["gather", "fold_pre", "swap", "fma", "load", "wide", "zdot"])
def test_lab_variants_compute_the_reference_attention(variant):
    seed = fresh_seed()
    key = jax.random.key(seed)
    lay = harness.uniform(harness.D)
    case = harness.PagedCase(lay, 1, np.full(1, 4 * quant_lab.P), quant_lab.P, 1, key)
    fmt = PageFormat.for_layout(lay, quant_lab.P, 4)
    pool = fmt.encode(case.k, case.v)
    q = harness.randn(jax.random.fold_in(key, 1), (1, lay.q_cols))
    table = case.tables[0]
    got = quant_lab.lab_decode(
        q,
        pool,
        quant_lab.meta_view(pool),
        table,
        variant=variant,
        nc=2,
        splits=1,
        fmt=fmt,
        num_warps=4,
        interpret=True,
    )
    want = quantized_decode_attention(
        q.astype(jnp.float32), pool, create_tail(fmt, 1, jnp.bfloat16), fmt, table, jnp.asarray(case.lengths), lay
    )
    if variant == "load":  # the ablation computes no attention: only that it runs
        assert got.shape == want.shape
        return
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    assert err < 2e-2, f"seed {seed}: {variant} relative error {err}"
