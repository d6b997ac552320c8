"""The one column encoding every Pallas kernel reads (``ops.columns``), against the packed layout it describes: on
random layouts, each head's table row slices exactly its own columns out of packed q, K, V and output rows."""

import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops import columns


def random_layout(rng) -> HeadLayout:
    kv, group = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4]))
    d = int(rng.choice([32, 64, 128]))
    widths = lambda: tuple(int(w) for w in rng.integers(1, d // 16 + 1, kv) * 16)  # noqa: E731
    return HeadLayout(kv * group, kv, d, widths(), widths())


@pytest.mark.parametrize("trial", range(20))
def test_each_head_row_slices_its_own_columns(trial):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = random_layout(rng)
    g = layout.group_size
    table = columns.head_columns(layout) * columns.UNIT
    q_owner = np.repeat(np.arange(layout.num_kv_heads), [g * w for w in layout.k_widths])
    k_owner = np.repeat(np.arange(layout.num_kv_heads), layout.k_widths)
    v_owner = np.repeat(np.arange(layout.num_kv_heads), layout.v_widths)
    o_owner = np.repeat(np.arange(layout.num_kv_heads), [g * w for w in layout.v_widths])
    for h, row in enumerate(table):
        kw, vw = row[columns.K_WIDTH], row[columns.V_WIDTH]
        assert (kw, vw) == (layout.k_widths[h], layout.v_widths[h]), f"seed {seed}"
        for owner, off, width in (
            (q_owner, row[columns.Q_OFF], g * kw),
            (k_owner, row[columns.K_OFF], kw),
            (v_owner, row[columns.V_OFF], vw),
            (o_owner, row[columns.O_OFF], g * vw),
        ):
            assert (owner[off : off + width] == h).all() and width == (owner == h).sum(), f"seed {seed}, head {h}"
    widths = columns.row_widths(layout) * columns.UNIT
    assert list(widths) == [len(q_owner), len(k_owner), len(v_owner), len(o_owner)]


def test_full_width_queries_and_a_subset_of_heads():
    layout = HeadLayout(8, 4, 64, (16, 32, 48, 64), (64, 48, 32, 16))
    table = columns.head_columns(layout, (2, 0), q_width=64) * columns.UNIT
    assert table[:, columns.Q_OFF].tolist() == [2 * 2 * 64, 0]  # head h's queries at h * G * d
    assert table[:, columns.K_OFF].tolist() == [48, 0] and table[:, columns.V_WIDTH].tolist() == [32, 64]
    assert (columns.row_widths(layout, q_cols=8 * 64) * 16).tolist() == [512, 160, 160, 320]


def test_a_width_the_kernels_cannot_load_is_refused_by_name():
    with pytest.raises(ValueError, match="multiples of 16"):
        columns.head_columns(HeadLayout(2, 1, 64, (24,), (64,)))
