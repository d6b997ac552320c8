"""The GEAR decode kernel (``ops.decode.gear_kernel``) against the jnp reference, which rebuilds every key and value
from its pages first (interpret mode on the CPU; compiled on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed
from test_quant_decode import quant_inputs, rel_err, tolerance

from kvjax.layout import HeadLayout
from kvjax.ops.decode.gear_kernel import gear_paged_decode
from kvjax.ops.decode.reference import quantized_decode_attention
from kvjax.ops.gear import GearPageFormat, GearSpec
from kvjax.ops.lowering import triton_modules

_encode = jax.jit(GearPageFormat.encode, static_argnums=0)
_reference = jax.jit(quantized_decode_attention, static_argnames=("fmt", "layout"))


def gear_inputs(rng, layout, lengths, fmt, dtype):
    """``quant_inputs``' random q, pages (here GEAR's, a few entries far out so the outliers matter), tables and
    tails."""
    return quant_inputs(rng, layout, lengths, fmt, dtype, encode=_encode, far_out=0.01)


def reference(q, pages, tail, fmt, table, lengths, layout):
    with jax.default_matmul_precision("highest"):
        return _reference(q.astype(jnp.float32), pages, tail.astype(jnp.float32), fmt, table, lengths, layout)


PAIRS = HeadLayout(6, 3, 64, (32, 64, 32), (64, 16, 64))  # G 2; heads 0 and 2 share a (K, V) pair, head 1 its own
CASES = {
    # name: (layout, spec, dtype, lengths). Lengths: 1 (tail only), whole pages (an empty tail), inside a page.
    "gear2 r1 p16 f32": (PAIRS, GearSpec(2, 1, 0.02, 16), jnp.float32, [1, 16, 37, 70]),
    "gear4 r2 p32 G4 f32": (HeadLayout(8, 2, 64, (48, 64), (64, 32)), GearSpec(4, 2, 0.01, 32), jnp.float32, [96, 45]),
    "no outliers": (PAIRS, GearSpec(2, 2, 0.0, 16), jnp.float32, [40, 5]),
    "byte positions, page 8": (HeadLayout(4, 2, 32, (16, 32), (32, 16)), GearSpec(2, 1, 0.05, 8), jnp.float32, [29, 8]),
    "window": (HeadLayout(4, 2, 64, (32, 64), (64, 32), 20), GearSpec(2, 1, 0.02, 16), jnp.float32, [70, 19, 33]),
    "bf16": (PAIRS, GearSpec(2, 1, 0.01, 32), jnp.bfloat16, [50, 64]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_equals_the_reference_that_rebuilds_every_key(name):
    layout, spec, dtype, lengths = CASES[name]
    fmt = GearPageFormat.for_layout(layout, spec)
    rng = np.random.default_rng(fresh_seed())
    q, pages, tail, table, lens = gear_inputs(rng, layout, lengths, fmt, dtype)
    out = gear_paged_decode(q, pages, tail, table, lens, layout, fmt, interpret=True)
    want = reference(q, pages, tail, fmt, table, lens, layout)
    assert out.shape == want.shape and out.dtype == q.dtype
    if dtype == jnp.float32:
        err = np.abs(np.asarray(out) - np.asarray(want))
        assert err.max() <= 2e-4, (name, err.max())
    else:  # bf16 rounds outputs near 8 to steps of 1/16: no absolute bound under that holds; the norm's, as for KIVI's
        assert rel_err(out, want) <= tolerance(dtype), (name, rel_err(out, want))


def test_four_byte_positions():
    """Pages of more than 2^16 entries a head store each outlier's position in 4 bytes, read as two halves."""
    layout = HeadLayout(2, 1, 128, (128,), (128,))
    fmt = GearPageFormat.for_layout(layout, GearSpec(2, 1, 0.0005, 1024))
    assert fmt.head_parts("k", 0)["outlier_index"][1] == jnp.uint32
    rng = np.random.default_rng(fresh_seed())
    q, pages, tail, table, lens = gear_inputs(rng, layout, [1030], fmt, jnp.float32)
    out = gear_paged_decode(q, pages, tail, table, lens, layout, fmt, interpret=True)
    want = reference(q, pages, tail, fmt, table, lens, layout)
    assert np.abs(np.asarray(out) - np.asarray(want)).max() <= 2e-4


def test_outliers_change_what_the_kernel_returns():
    """The sparse and low-rank terms are read, not skipped: the same codes without them give other outputs, and
    the kernel follows the pages it is given."""
    layout = PAIRS
    fmt = GearPageFormat.for_layout(layout, GearSpec(2, 1, 0.05, 16))
    rng = np.random.default_rng(fresh_seed())
    q, pages, tail, table, lens = gear_inputs(rng, layout, [48], fmt, jnp.float32)
    out = gear_paged_decode(q, pages, tail, table, lens, layout, fmt, interpret=True)
    # zero every page's outlier values and factors: the reference and the kernel move together, away from `out`
    cut = np.asarray(pages).copy()
    for side in ("k", "v"):
        for h in range(layout.num_kv_heads):
            for part in ("outliers", "a"):
                start, dtype, shape = fmt.head_parts(side, h)[part]
                cut[:, start : start + int(np.prod(shape)) * dtype.itemsize] = 0
    cut = jnp.asarray(cut)
    out_cut = gear_paged_decode(q, cut, tail, table, lens, layout, fmt, interpret=True)
    assert np.abs(np.asarray(out_cut) - np.asarray(reference(q, cut, tail, fmt, table, lens, layout))).max() <= 2e-4
    assert np.abs(np.asarray(out_cut) - np.asarray(out)).max() > 1e-2


def test_bad_inputs_are_one_line_value_errors():
    layout = PAIRS
    fmt = GearPageFormat.for_layout(layout, GearSpec(2, 1, 0.02, 16))
    rng = np.random.default_rng(fresh_seed())
    q, pages, tail, table, lens = gear_inputs(rng, layout, [20], fmt, jnp.float32)
    other = GearPageFormat.for_layout(HeadLayout(6, 3, 64, (64,) * 3, (64,) * 3), GearSpec(2, 1, 0.02, 16))
    for args, match in (
        ((q, pages, tail, table, lens, layout, other), "do not match"),
        ((q[:, :-16], pages, tail, table, lens, layout, fmt), "q must be"),
        ((q, pages[:, :-16], tail, table, lens, layout, fmt), "pages must be"),
        ((q, pages, tail[:, :-1], table, lens, layout, fmt), "tail must be"),
    ):
        with pytest.raises(ValueError, match=match):
            gear_paged_decode(*args, interpret=True)


@pytest.mark.parametrize("name", ["gear2 r1 p16 f32", "byte positions, page 8", "window", "bf16"])
def test_the_kernel_lowers_to_triton_for_the_gpu(name):
    """What a GPU would compile, lowered on the CPU: a kernel a (K, V) width pair, named by it."""
    layout, spec, dtype, lengths = CASES[name]
    fmt = GearPageFormat.for_layout(layout, spec)
    rng = np.random.default_rng(fresh_seed())
    args = gear_inputs(rng, layout, lengths, fmt, dtype)
    modules = triton_modules(lambda *a: gear_paged_decode(*a, layout, fmt), args)
    pairs = {(k, v) for k, v in zip(layout.k_widths, layout.v_widths)}
    assert len(modules) == len(pairs) and all("tt.dot" in m for m in modules)
