"""``kvjax.compress``: calibrate a model, plan each head's ranks, and fold the bases into its weights."""

from __future__ import annotations

from kvjax import validate
from kvjax.compression.calibration import CalibrationStats, calibrate, calibration_tokens
from kvjax.compression.folding import fold
from kvjax.compression.plan import METHODS, RankPlan

BASIS = {"zack": ("qk", "v"), "palu": ("k_pre", "v")}  # each method's K and V bases (CalibrationStats.basis)


def _check_request(target_rate, removal_rate, method) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (target_rate is None) == (removal_rate is None):
        raise ValueError("give exactly one of target_rate and removal_rate")
    for name, value in (("target_rate", target_rate), ("removal_rate", removal_rate)):
        if value is not None:
            validate.rate(name, value)


def make_plan(
    model,
    stats: CalibrationStats,
    *,
    target_rate=None,
    removal_rate=None,
    method="zack",
    adaptive=True,
    order_heads=True,
    fill_tiles=False,
) -> tuple[RankPlan, dict]:
    """The rank plan and the bases it truncates ({"k": Basis, "v": Basis}), from calibration statistics (cheap).

    ``fill_tiles``: move up to 32 columns a head between each layer's heads, at the same rate, where that lets the
    decode kernel's runs fill their tiles (``RankPlan.filled_for_runs``: faster decode for some accuracy; adaptive
    zack plans only).
    ``order_heads``: reorder each layer's KV heads so the decode kernel reads adjacent narrow heads as one
    (``RankPlan.ordered_for_runs``; the model's output does not change)."""
    _check_request(target_rate, removal_rate, method)
    k_basis, v_basis = (stats.basis(kind, model) for kind in BASIS[method])
    if target_rate is not None:
        plan = RankPlan.for_target_rate(method, k_basis.s, v_basis.s, target_rate, adaptive)
    else:
        plan = RankPlan.from_removal_rate(method, k_basis.s, v_basis.s, removal_rate, adaptive)
    if fill_tiles and adaptive and method == "zack":
        plan = plan.filled_for_runs(model.layouts[0].group_size)
    if order_heads:
        plan = plan.ordered_for_runs(model.layouts[0].group_size)
    return plan, {"k": k_basis, "v": v_basis}


def compress(
    model,
    target_rate=None,
    removal_rate=None,
    method="zack",
    adaptive=True,
    calibration="random",
    num_tokens=16384,
    seed=0,
    *,
    seq_len=512,
    batch_size=4,
    order_heads=True,
    fill_tiles=False,
    progress=True,
):
    """Compress ``model``'s KV cache along the head dimension; returns a new ``kvjax.Model`` with ``.plan``.

    Give exactly one of ``target_rate`` (overall rate p in [0, 1), reached by bisection on the removal rate) and
    ``removal_rate`` (the singular-value mass r each head may drop). ``calibration``: "random" token ids, "text"
    (Python's pydoc topics), "text:PATH", or token ids. ``method="palu"`` is the pre-RoPE low-rank baseline.
    ``order_heads``: store each layer's KV heads in the order the decode kernel reads fastest (output unchanged).
    ``fill_tiles``: move a few columns between a layer's heads, at the same rate, so the kernel's runs fill their
    tiles: faster decode, some accuracy lost, ranks within 32 columns a head of the calibrated ones
    (bench/RESULTS.md "Decode: filled tiles").
    """
    _check_request(target_rate, removal_rate, method)  # before the (slow) calibration
    num_tokens, seq_len = validate.positive("num_tokens", num_tokens), validate.positive("seq_len", seq_len)
    batch_size, seed = validate.positive("batch_size", batch_size), validate.seed(seed)
    if model.plan is not None:
        raise ValueError("model is already compressed; compress the original model")
    tokens = calibration_tokens(model, calibration, num_tokens, min(seq_len, num_tokens), seed)
    stats = calibrate(model, tokens, batch_size=batch_size, progress=progress)
    plan, bases = make_plan(
        model,
        stats,
        target_rate=target_rate,
        removal_rate=removal_rate,
        method=method,
        adaptive=adaptive,
        order_heads=order_heads,
        fill_tiles=fill_tiles,
    )
    return fold(model, plan, bases)
