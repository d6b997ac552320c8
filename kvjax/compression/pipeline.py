"""``kvjax.compress``: calibrate a model, plan each head's ranks, and fold the bases into its weights."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import validate
from kvjax.compression.calibration import CalibrationStats, calibrate, calibration_tokens, check_source
from kvjax.compression.folding import fold
from kvjax.compression.plan import (
    ALIGN,
    METHODS,
    QK_BASES,
    QK_WIDTHS,
    RankPlan,
    check_band,
    check_kv_bits,
    check_qk_basis,
    check_qk_widths,
)
from kvjax.compression.sensitivity import Sensitivity, allocate, measure
from kvjax.compression.split import best_share, kl_to

BASIS = {"zack": ("qk", "v"), "palu": ("k_pre", "v")}  # each method's K and V bases (CalibrationStats.basis)


RANKS = ("spectrum", "measured")  # ``compress``'s rank rules: F_p's shared removal rate, or measured effect
MODEL_CONTEXT = "model"  # ``compress``'s default max_context: the positions the model serves, its context length


def served_positions(model, method: str, max_context, band=None):
    """``compress``'s ``max_context`` resolved for ``model``: ``"model"`` (the default) is the model's context length
    (``config.max_position_embeddings``) for plain ZACK and None for Palu and banded ZACK (a pre-RoPE basis, or a
    band's frame, serves every position); an int or None (the positions calibration saw) as given. Past the
    positions it was made for, a post-RoPE basis degrades (bench/results/accuracy.md "Compression: the basis for the
    served positions"): the default covers all of them."""
    if isinstance(max_context, str):
        if max_context != MODEL_CONTEXT:
            raise ValueError(f"max_context must be {MODEL_CONTEXT!r}, a positive integer or None, got {max_context!r}")
        return int(model.config.max_position_embeddings) if method == "zack" and band is None else None
    return max_context


def _check_request(target_rate, removal_rate, method, max_context=None) -> int | None:
    """Refuse a bad request before any work; returns ``max_context`` checked (None stays None)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (target_rate is None) == (removal_rate is None):
        raise ValueError("give exactly one of target_rate and removal_rate")
    for name, value in (("target_rate", target_rate), ("removal_rate", removal_rate)):
        if value is not None:
            validate.rate(name, value)
    if max_context is None:
        return None
    if method != "zack":
        raise ValueError(f"max_context applies to method='zack' (a post-RoPE basis), not {method!r}")
    return validate.positive("max_context", max_context)


def check_finite_weights(model) -> None:
    """Every parameter of ``model`` is finite; else a ValueError naming the first that is not (its calibration
    statistics would be NaN, and a plan made from them keeps nothing of the model)."""
    flat = list(nnx.to_flat_state(nnx.state(model.module, nnx.Param)))
    finite = jax.device_get([jnp.isfinite(var.get_value()).all() for _, var in flat])
    for (path, _), ok in zip(flat, finite):
        if not ok:
            name = ".".join(map(str, path))
            raise ValueError(
                f"model parameter {name} holds NaN or infinite values: kvjax.compress needs finite weights"
            )


def check_finite_stats(stats: CalibrationStats) -> None:
    """Every calibration Gram is finite; else a ValueError naming the first layer and KV head whose is not."""
    bad = {kind: ~np.isfinite(g).all(axis=(-2, -1)) for kind, g in stats.grams.items()}  # kind -> [L, Hkv]
    for layer in range(len(next(iter(bad.values()), []))):
        for kind, heads in bad.items():
            if heads[layer].any():
                head = int(np.argmax(heads[layer]))
                raise ValueError(
                    f"calibration statistics of layer {layer} (the {kind!r} Gram of KV head {head}) hold NaN or "
                    "infinite values: the model's activations are not finite on the calibration tokens"
                )


def _warn_far_from_target(plan: RankPlan, target_rate) -> None:
    """Warn when the plan's rate is further above ``target_rate`` than rounding every head's widths can explain."""
    if target_rate is not None and plan.rate - target_rate > ALIGN / plan.head_dim + 1e-9:
        warnings.warn(
            f"kvjax.compress reached an overall rate of {plan.rate:.4f}, far above the target_rate {target_rate} "
            "asked for: the calibration statistics span fewer directions than that rate keeps (too few calibration "
            "tokens, or a degenerate model)",
            stacklevel=3,
        )


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
    max_context=None,
    k_share=None,
    band=None,
    sensitivity: Sensitivity | None = None,
    qk_basis="shared",
    qk_widths="shared",
) -> tuple[RankPlan, dict]:
    """The rank plan and the bases it truncates ({"k": Basis, "v": Basis}), from calibration statistics (cheap).

    ``fill_tiles``: move up to 32 columns a head between each layer's heads, at the same rate, where that lets the
    decode kernel's runs fill their tiles (``RankPlan.filled_for_runs``: faster decode for some accuracy; adaptive
    zack plans only).
    ``order_heads``: reorder each layer's KV heads so the decode kernel reads adjacent narrow heads as one
    (``RankPlan.ordered_for_runs``; the model's output does not change).
    ``max_context``: take ZACK's Q/K basis for positions 0..max_context-1, derived from the pre-RoPE statistics,
    not for the positions calibration saw (recorded in the plan).
    ``band`` (zack): store keys in banded frames of ``band`` positions, the Q/K basis that of positions
    0..band-1 (``RankPlan.band``; then ``max_context`` must be None).
    ``k_share`` (with ``target_rate``): the share of the kept columns Q/K gets (``RankPlan.for_target_rate``);
    None: one removal rate for both (adaptive) or an even split (uniform).
    ``sensitivity`` (with ``target_rate``, adaptive, no ``k_share``): ranks by measured effect
    (``sensitivity.allocate``), from probes of this method, band, ``max_context`` and ``qk_basis``
    (``measure_sensitivity``).
    ``qk_basis`` (zack): "shared" (ZACK's one orthogonal rotation) or "pair" (queries and keys on a score-aware
    pair, ``CalibrationStats.basis("qk-pair")``, recorded in the plan).
    ``qk_widths`` (a pair under F_p): the spectrum F_p reads its Q/K widths off, "shared" (the shared basis's, so
    the pair changes only the directions) or "pair" (its own singular values: fewer Q/K columns, more V; better on
    Gemma 3 at 0.3, worse at 0.5: bench/results/accuracy.md "Which Q/K basis: held-in rows as long as the windows").
    Measured ranks read the pair's own singular values (the probed directions' energy)."""
    max_context = _check_request(target_rate, removal_rate, method, max_context)
    if sensitivity is not None:
        _check_measured(target_rate, adaptive, k_share)
    band = check_band(band, method, max_context)
    pair = check_qk_basis(qk_basis, method) == "pair"
    ranks = "measured" if sensitivity is not None else None
    qk_widths = check_qk_widths(qk_widths, "pair" if pair else None, ranks, adaptive)
    k_kind, v_kind = BASIS[method]
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero Gram: said below, naming its layer
        positions = band if band is not None else max_context  # a band's frame: the basis of its W offsets
        spectrum, v_basis = stats.basis(k_kind, model, max_context=positions), stats.basis(v_kind, model)
        k_basis = stats.basis("qk-pair", model, max_context=positions) if pair else spectrum
    checked = ((k_kind, spectrum), (v_kind, v_basis)) + ((("qk-pair", k_basis),) if pair else ())
    for kind, basis in checked:
        bad = ~np.isfinite(basis.s).all(axis=-1)  # [L, Hkv]
        if bad.any():
            layer, head = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"calibration statistics of layer {layer} (KV head {head}) give no {kind!r} basis: its activations "
                "are all zero or not finite on the calibration tokens"
            )
    if sensitivity is not None:
        k_qk, k_v = allocate(k_basis.s, v_basis.s, sensitivity, target_rate)
        plan = RankPlan(method, k_basis.s.shape[-1], k_qk, k_v, k_basis.s, v_basis.s, ranks="measured")
    elif target_rate is not None:
        s_qk = k_basis.s if qk_widths == "pair" else spectrum.s
        plan = RankPlan.for_target_rate(method, s_qk, v_basis.s, target_rate, adaptive, k_share=k_share)
    elif k_share is not None:
        raise ValueError("k_share splits a target rate's columns: give target_rate, not removal_rate")
    else:
        s_qk = k_basis.s if qk_widths == "pair" else spectrum.s
        plan = RankPlan.from_removal_rate(method, s_qk, v_basis.s, removal_rate, adaptive)
    plan = dataclasses.replace(
        plan, max_context=max_context, band=band, qk_basis="pair" if pair else None, qk_widths=qk_widths
    )
    if fill_tiles and adaptive and method == "zack":
        plan = plan.filled_for_runs(model.layouts[0].group_size)
    if order_heads:
        plan = plan.ordered_for_runs(model.layouts[0].group_size)
    return plan, {"k": k_basis, "v": v_basis}


def _check_measured(target_rate, adaptive, k_share) -> None:
    """Ranks by measured effect split a target rate's columns between K and V themselves: a ValueError otherwise."""
    if target_rate is None or not adaptive or k_share is not None:
        raise ValueError(
            "ranks='measured' takes a target_rate, adaptive=True and no k_share (it splits K and V by measured "
            "effect itself)"
        )


PROBE_ROWS, PROBE_TOKENS = 2, 1024  # what a sensitivity probe is scored on: rows longer than calibration's
PICK_TOKENS = 4096  # the rows qk_basis="measured" scores on (PROBE_ROWS of them): as long as the windows it must rank


def _probe_tokens(model, calibration, seed: int, tokens, length: int | None = None) -> np.ndarray:
    """Held-in rows to score compressed models on: ``PROBE_ROWS`` rows of ``length`` tokens (default
    ``PROBE_TOKENS``, what sensitivity probes use; at most the model's context) from the calibration source, since
    a head's effect at a 512-token row understates what it does at 4K (keys far back); rows of ``PROBE_TOKENS``
    where the source is too short for ``length``, and the calibration rows ``tokens`` where it is too short for
    that."""
    for want in dict.fromkeys((length or PROBE_TOKENS, PROBE_TOKENS)):
        rows = min(want, int(model.config.max_position_embeddings))
        try:
            return calibration_tokens(model, calibration, PROBE_ROWS * rows, rows, seed)
        except ValueError:
            continue
    return tokens


def measure_sensitivity(
    model,
    stats: CalibrationStats,
    calibration,
    tokens,
    *,
    seed=0,
    method="zack",
    max_context=None,
    band=None,
    qk_basis="shared",
    progress=True,
) -> Sensitivity:
    """Each head's measured effect on ``model``'s outputs for ``make_plan(sensitivity=)``: the bases of ``method``
    (with ``max_context``, ``band`` and ``qk_basis``) probed head by head (``sensitivity.measure``) and scored by KL
    on held-in rows of the ``calibration`` source (``_probe_tokens``; ``tokens``, the calibration rows, where it is
    too short)."""
    full, bases = make_plan(
        model,
        stats,
        removal_rate=0.0,
        method=method,
        max_context=max_context,
        band=band,
        order_heads=False,
        qk_basis=qk_basis,
    )
    probes = _probe_tokens(model, calibration, seed, tokens)
    return measure(model, full, bases, kl_to(model, probes, len(probes)), progress=progress)


def compress(
    model,
    target_rate=None,
    removal_rate=None,
    method="zack",
    adaptive=True,
    calibration="text",
    num_tokens=16384,
    seed=0,
    *,
    seq_len=512,
    batch_size=4,
    order_heads=True,
    fill_tiles=False,
    max_context=MODEL_CONTEXT,
    k_share=None,
    band=None,
    ranks="spectrum",
    kv_bits="model",
    qk_basis="shared",
    qk_widths="shared",
    progress=True,
):
    """Compress ``model``'s KV cache along the head dimension; returns a new ``kvjax.Model`` with ``.plan``.

    Give exactly one of ``target_rate`` (overall rate p in [0, 1), reached by bisection on the removal rate) and
    ``removal_rate`` (the singular-value mass r each head may drop). ``calibration``: "text" (default: real
    text, rows alternating English prose and Python code, both PSF-licensed and shipped with Python: the
    calibration parts of ``compression.text``, disjoint from its held-out ones), "prose" or "code" (one domain),
    "text:PATH" (a UTF-8 file), "random" token ids (for a model without a tokenizer), or token ids.
    ``method="palu"`` is the pre-RoPE low-rank baseline.
    ``order_heads``: store each layer's KV heads in the order the decode kernel reads fastest (output unchanged).
    ``fill_tiles``: move a few columns between a layer's heads, at the same rate, so the kernel's runs fill their
    tiles: faster decode, some accuracy lost, ranks within 32 columns a head of the calibrated ones
    (bench/results/kernels.md "Decode: filled tiles").
    ``max_context`` (zack): the positions the Q/K basis serves, derived for 0..max_context-1 from pre-RoPE
    statistics, so it holds past the calibration rows' ``seq_len``: ``"model"`` (default) the model's context
    length, an int the longest prompt + new tokens the model will serve, or None the positions calibration saw
    (which degrades past them). Recorded in the plan; ``kvjax.generate`` and ``kvjax-serve`` warn beyond it.
    ``k_share`` (with ``target_rate``): the share of the kept columns that Q/K gets, V the rest, each spread over
    its heads by its own removal rate (adaptive) or evenly (uniform); "measured" tries shares 0.3-0.7 and keeps the
    one whose model stays closest (KL) to this one on held-in calibration rows (``compression.split``; a fold and
    a forward pass a share); None (default): one removal rate for both (adaptive), or half each (uniform: one rate
    for K and V, the ZACK paper's ZACK/AC).
    ``band`` (zack): banded ZACK, a variant beside the paper's method: each key is stored in the frame of its band of
    ``band`` positions (16, 32 or 64: a power of two), whose basis is that of positions 0..band-1 turned by the band's
    start angle, so one basis fits every position and no ``max_context`` applies (DESIGN.md section 7, "Banded
    bases"). Decode projects each query once a band (bands of 16 or more; narrower ones on Palu's kernel), prefill
    rebuilds keys at full width; quantized pages are refused.
    ``ranks`` (with ``target_rate``, adaptive): "spectrum" (default) gives every head the widths of one shared
    removal rate on its singular values (F_p); "measured" probes each head's Q/K and V at half width, scores each
    probe by KL to this model on two held-in calibration rows of 1,024 tokens, and spends the rate where that costs
    least, K and V together (``compression.sensitivity``: 2·L·Hkv extra forward passes, no k_share).
    ``qk_basis`` (zack): the directions queries and keys are projected on. "shared" (default): the paper's one
    orthogonal rotation of both. "pair": a score-aware pair, queries on A and keys on B (``A B^T = I``), the pair
    whose truncation least changes the scores q·k rather than q's and k's own energies; the cache holds the same
    bytes and nothing is rebuilt (bench/results/accuracy.md "A score-aware Q/K pair in the library": at band 16,
    0.82-0.84x Palu's KL on Gemma 3 at rate 0.5 where the shared basis is 1.32-1.39x; on SmolLM2 3-5% better than
    the shared basis at 0.5 and 3-8% worse at 0.3). ``qk_widths`` (a pair, adaptive, F_p's ranks): "shared"
    (default) reads the pair's widths off the shared basis's spectrum, "pair" off its own (``make_plan``).
    "measured": folds the candidates (the shared basis; the pair with either ``qk_widths`` under F_p, the pair
    alone otherwise) and keeps the one whose model stays closest (KL) to this one on two held-in calibration rows
    of 4,096 tokens (a fold and a forward pass each, decided before ``k_share`` or ``ranks`` are measured; it
    ranked them as 4K held-out windows do in every cell measured: bench/results/accuracy.md "Which Q/K basis:
    held-in rows as long as the windows").
    ``kv_bits``: the quantized pages the returned model asks to be served from (``Model.kv_bits``, saved with it):
    4 or 2, None (pages of the cache's dtype), or "model" (default): ``model``'s own. Palu models refuse 4 and 2,
    before any calibration, in the engine's words.
    """
    model.need_weights("kvjax.compress")
    max_context = served_positions(model, method, max_context, band)
    _check_request(target_rate, removal_rate, method, max_context)  # before the (slow) calibration
    band = check_band(band, method, max_context)
    kv_bits = _check_kv_bits(model, kv_bits, method, band)
    if k_share is not None:
        share = isinstance(k_share, (int, float)) and not isinstance(k_share, bool) and 0 < k_share < 1
        if target_rate is None or not (share or k_share == "measured"):
            raise ValueError(f"k_share takes a target_rate and a share in (0, 1) or 'measured', got {k_share!r}")
    if ranks not in RANKS:
        raise ValueError(f"ranks must be one of {RANKS}, got {ranks!r}")
    if ranks == "measured":
        _check_measured(target_rate, adaptive, k_share)
    _check_qk_request(qk_basis, method, qk_widths, adaptive, ranks)
    num_tokens, seq_len = validate.positive("num_tokens", num_tokens), validate.positive("seq_len", seq_len)
    batch_size, seed = validate.positive("batch_size", batch_size), validate.seed(seed)
    if model.plan is not None:
        raise ValueError("model is already compressed; compress the original model")
    check_source(model, calibration)  # an unknown source, or text for a model without a tokenizer
    check_finite_weights(model)
    tokens = calibration_tokens(model, calibration, num_tokens, min(seq_len, num_tokens), seed)
    stats = calibrate(model, tokens, batch_size=batch_size, progress=progress)
    check_finite_stats(stats)
    settings = dict(
        target_rate=target_rate,
        removal_rate=removal_rate,
        method=method,
        adaptive=adaptive,
        max_context=max_context,
        band=band,
    )
    if qk_basis == "measured":
        widths = adaptive and ranks != "measured"  # whether F_p reads the widths, so the spectrum is a choice too
        qk_basis, qk_widths = pick_qk_basis(model, stats, calibration, tokens, seed, settings, widths)
    settings |= dict(qk_basis=qk_basis, qk_widths=qk_widths)
    if k_share == "measured":
        score = kl_to(model, tokens, batch_size, release=True)
        k_share, _ = best_share(lambda f: score(fold(model, *make_plan(model, stats, k_share=f, **settings))))
    if ranks == "measured":
        where = dict(method=method, max_context=max_context, band=band, qk_basis=qk_basis, seed=seed)
        where["progress"] = progress
        settings["sensitivity"] = measure_sensitivity(model, stats, calibration, tokens, **where)
    plan, bases = make_plan(model, stats, order_heads=order_heads, fill_tiles=fill_tiles, k_share=k_share, **settings)
    _warn_far_from_target(plan, target_rate)
    compressed = fold(model, plan, bases)
    compressed.kv_bits = kv_bits
    return compressed


def _check_qk_request(qk_basis, method: str, qk_widths="shared", adaptive=True, ranks="spectrum") -> None:
    """``compress``'s ``qk_basis`` (one of ``QK_BASES`` or "measured", and other than "shared" only for ZACK) and
    ``qk_widths`` (one of ``QK_WIDTHS``, "pair" only for a pair whose widths F_p reads: adaptive, spectrum ranks)."""
    if not (isinstance(qk_basis, str) and qk_basis in (*QK_BASES, "measured")):
        raise ValueError(f"qk_basis must be one of {(*QK_BASES, 'measured')}, got {qk_basis!r}")
    if qk_basis != "shared" and method != "zack":
        raise ValueError(f"qk_basis={qk_basis!r} applies to method='zack' (a post-RoPE basis), not {method!r}")
    if not (isinstance(qk_widths, str) and qk_widths in QK_WIDTHS):
        raise ValueError(f"qk_widths must be one of {QK_WIDTHS}, got {qk_widths!r}")
    if qk_widths == "pair" and (qk_basis != "pair" or not adaptive or ranks != "spectrum"):
        raise ValueError(
            "qk_widths='pair' applies to qk_basis='pair' with adaptive F_p ranks (qk_basis='measured' picks the "
            "widths itself)"
        )


def pick_qk_basis(model, stats, calibration, tokens, seed: int, settings: dict, widths: bool) -> tuple[str, str]:
    """``compress(qk_basis="measured")``'s choice of (qk_basis, qk_widths): the shared basis, the pair with the shared
    spectrum's widths, and (``widths``: F_p reads the widths) the pair with its own, whichever folds (at
    ``settings``' rate) into a model closest (KL) to ``model`` on ``PROBE_ROWS`` held-in rows of ``PICK_TOKENS``
    (``_probe_tokens``); the earlier candidate on a tie. Rows of 1,024 tokens picked the pair in every cell
    measured, also where 4K windows rank the shared basis lower; 4K rows rank them as the windows do
    (bench/results/accuracy.md "Which Q/K basis: held-in rows as long as the windows")."""
    candidates = [("shared", "shared"), ("pair", "shared")] + ([("pair", "pair")] if widths else [])
    probes = _probe_tokens(model, calibration, seed, tokens, PICK_TOKENS)
    score = kl_to(model, probes, len(probes), release=True)
    kl = [score(fold(model, *make_plan(model, stats, qk_basis=b, qk_widths=w, **settings))) for b, w in candidates]
    return candidates[int(np.argmin(kl))]


def _check_kv_bits(model, kv_bits, method: str, band=None) -> int | str | None:
    """``compress``'s ``kv_bits`` checked for ``method`` (and ``band``): "model" stands for ``model.kv_bits``, which
    a Palu or banded plan refuses with a hint of where it came from."""
    if isinstance(kv_bits, str) and kv_bits == "model":
        try:
            return check_kv_bits(model.kv_bits, method, band)
        except ValueError as e:
            raise ValueError(f"{e} (kv_bits={model.kv_bits} is the model's own: pass kv_bits=None)") from None
    return check_kv_bits(kv_bits, method, band)
