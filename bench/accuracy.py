"""How much quality KV compression costs, measured the same way every time: perplexity on held-out text (the second
half of Python's ``pydoc_data.topics``; calibration text comes from the first half) and teacher-forced greedy
agreement with the uncompressed model over N held-out prompts continued M tokens, per variant (ZACK adaptive or
uniform ranks, Palu adaptive or uniform) and calibration source (random token ids, text, prose, code); "99% of
baseline" = perplexity within +1% and agreement >= 99%. Results: bench/results/accuracy.md "Compression accuracy
(SmolLM2)" and "GGUF perplexity vs transformers".

Mode ``eval`` scores longer contexts on two kinds of held-out text, prose (pydoc topics) and code (standard-library
sources, ``kvjax.compression.text.stdlib_code``), in windows of 1K and 4K tokens: perplexity, and against the
uncompressed model's next-token distributions on the same windows, the mean per-token KL(base || compressed) and
top-1 agreement. With ``--bisect-steps N`` it then finds, per model group and source, the largest target rate whose
perplexity (within +1%) or top-1 agreement (>= 99%) on the longest window stays at 99% of baseline: the bracket
from the ``--rates`` grid, bisected N times. ``--kv-bits`` scores every model (the uncompressed one too: "4-bit
alone") also as served from a cache of 4- or 2-bit pages (``Model.hidden(kv=...)``), each setting its own model
group, against the same unquantized baseline; ``overall_rate`` is 1 - its cache bytes per token (codes, scales, zeros
and padding: ``kvjax.runtime.cache.token_bytes``) over the uncompressed model's in bfloat16.

Mode ``retrieval`` asks for a number hidden in a long prompt (``retrieval``: passkey and multi-key needle prompts of
1K-8K tokens, the key at depths 0..1 of the filler), answered greedily through ``kvjax.generate``: accuracy per
task, context and depth, for the uncompressed model and every variant and rate, with heat maps, and per model group,
task and context the largest grid rate whose mean accuracy stays within ``--retrieval-tolerance`` of the
uncompressed model's."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from bench import retrieval
from bench.files import write_json
from kvjax import validate
from kvjax.compression import calibrate, calibration_tokens, fold, make_plan
from kvjax.compression.calibration import principal_axes
from kvjax.compression.pipeline import measure_sensitivity, pick_qk_basis
from kvjax.compression.text import pydoc_text, stdlib_code
from kvjax.models.transformer import layer_layout
from kvjax.ops import kv_schemes
from kvjax.ops.quant import BITS
from kvjax.ops.quant import GROUP as PAGE_TOKENS
from kvjax.runtime.cache import token_bytes

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "smollm2_reference.npz")
SOURCES = {"prose": pydoc_text, "code": stdlib_code}  # eval's held-out text sources: part -> text
VARIANTS = {  # name -> (method, adaptive); palu-uniform (one rank for every head) is the FDC paper's baseline
    "zack": ("zack", True),
    "zack-uniform": ("zack", False),
    "palu": ("palu", True),
    "palu-uniform": ("palu", False),
    "zack-band16": ("zack", True),  # banded ZACK (``compress(band=W)``): keys in the frame of their band of W positions
    "zack-band32": ("zack", True),
    "zack-band64": ("zack", True),
    "zack-band1": ("zack", True),  # narrower than any kernel tile: diagnostics (band 1 is Palu's frame, ZACK's basis)
    "zack-band4": ("zack", True),
    # ranks by measured effect (``compress(ranks="measured")``): each head probed, KL per unit of energy, greedy
    "zack-measured": ("zack", True),
    "palu-measured": ("palu", True),
    "zack-band16-measured": ("zack", True),
    # a score-aware Q/K pair (``compress(qk_basis="pair")``): queries on A, keys on B, the same widths
    "zack-pair": ("zack", True),
    "zack-band16-pair": ("zack", True),
    "zack-band32-pair": ("zack", True),
    "zack-band64-pair": ("zack", True),
    "zack-band16-pair-measured": ("zack", True),  # both: the pair's directions, ranks by their measured effect
    "zack-band32-pair-measured": ("zack", True),
    "zack-band64-pair-measured": ("zack", True),
    "zack-band16-pair-own": ("zack", True),  # the pair, F_p's widths off its own spectrum (``qk_widths="pair"``)
    "zack-band32-pair-own": ("zack", True),
    "zack-band64-pair-own": ("zack", True),
    # the Q/K basis ``compress(qk_basis="measured")`` picks at each rate (``pipeline.pick_qk_basis``)
    "zack-pick": ("zack", True),
    "zack-band16-pick": ("zack", True),
    "zack-band32-pick": ("zack", True),
    "zack-band64-pick": ("zack", True),
}
MEASURED = {name for name in VARIANTS if name.endswith("-measured")}
PAIRS = {name for name in VARIANTS if "-pair" in name}
OWN_WIDTHS = {name for name in VARIANTS if name.endswith("-pair-own")}
PICKS = {name for name in VARIANTS if name.endswith("-pick")}
BANDS = {name: int(name.removeprefix("zack-band").split("-")[0]) for name in VARIANTS if name.startswith("zack-band")}


def qk_basis(variant) -> str:
    """The Q/K basis a variant's plans use (``make_plan(qk_basis=)``)."""
    return "pair" if variant in PAIRS else "shared"


def qk_widths(variant) -> str:
    """The spectrum F_p reads a variant's Q/K widths off (``make_plan(qk_widths=)``)."""
    return "pair" if variant in OWN_WIDTHS else "shared"


DEFAULT_VARIANTS = ["zack", "zack-uniform", "palu", "palu-uniform"]
GROUP = ("calibration", "variant", "max_context", "k_share", "kv_bits")  # what a model has besides its rate
AT_99 = {  # the 99%-of-baseline tests, (value, uncompressed value) -> passes: eval's bisection and Evaluator.meets
    "ppl": lambda value, base: value <= 1.01 * base,
    "top1": lambda value, base: value >= 0.99,
}
EPILOG = """modes:
  python -m bench.accuracy rates  --model smollm2 --rates 0.25 0.375 0.5 [--json out.json]
  python -m bench.accuracy search --model smollm2      # largest p meeting 99% of baseline, per variant
  python -m bench.accuracy stability --model smollm2   # rotation stability (the papers' Table 4)
  python -m bench.accuracy transformers                # SmolLM2 perplexity next to transformers'
  python -m bench.accuracy eval --windows 1024 4096 --rates 0.5 --calibrations text --max-context none 4096
  python -m bench.accuracy eval --rates 0.5 --k-share none 0.4 0.6     # one row per Q/K share of the kept columns
  python -m bench.accuracy eval --rates 0.25 0.5 0.625 --bisect-steps 4   # largest rate at 99% of baseline
  python -m bench.accuracy eval --calibrations random text prose code text:notes.txt --variants zack palu-uniform
  python -m bench.accuracy eval --rates 0.3 0.5 --variants zack --kv-bits none 4 2   # ranks and quantized pages
  python -m bench.accuracy eval --rates 0.3 0.5 --variants zack-band16 zack-band16-measured   # ranks by measured KL
  python -m bench.accuracy retrieval --task passkey multikey --contexts 1024 2048 4096 8192 --trials 50 \\
      --rates 0.5 --calibrations text --max-context 8200 --json retrieval.json --png-dir retrieval
  python -m bench.accuracy retrieval --rates 0.25 0.375 0.5 --retrieval-tolerance 0.02   # within 2 points of base

Agreement: the uncompressed model continues the prompts greedily; it is the fraction of those positions where the
compressed model, fed the same tokens, picks the same argmax (so one early difference does not count M times).
Calibration statistics are gathered once per source and reused for every rate. Eval runs each window once per model
group (calibration, variant, max_context, k_share, kv_bits) through the uncompressed model and reuses its log-probs
for every rate of the group; compressed models are folded again per window from their (cheap, kept) plans, so memory
holds one compressed model and two windows of log-probs at a time.
Calibration sources (kvjax.compression.calibration_tokens): "random" token ids, "text" (rows alternating prose and
code), "prose" (the calibration half of pydoc topics), "code" (the calibration part of the code source, files
disjoint from eval's) or "text:PATH". --k-share gives Q/K that share of the columns a rate keeps (V the rest;
"none": one removal rate for both; uniform variants split evenly). The -measured variants
(compress(ranks="measured")) probe every head once per group (2 x layers x KV heads forward passes over two held-in
rows of 1,024 calibration tokens) and reuse the probes for every rate; --k-share does not apply to them. Eval's
--bisect-steps probes are full evaluations (every source and window), each target rate once per group, rows marked
"probe"; its JSON is rewritten after each group, "complete" false until
the last. Eval's --kv-bits 4 2 (default none: unquantized only) score every model also over a cache of quantized
pages of --kv-page tokens (keys per column over a page, values per token, the newest partial page exact), the
uncompressed model too; ZACK and uncompressed models only (Palu's pre-RoPE K is rebuilt, not cached as pages).
overall_rate: 1 - cache bytes per token / the uncompressed model's in bfloat16 (the plan's rate without --kv-bits).
Retrieval builds each compressed model once and runs every task and context on it; a zack plan serving contexts
past its calibration's --seq-len wants --max-context at least the longest context plus --answer-tokens. Its JSON
holds every trial and is rewritten (whole) after each model, "complete" false until the last. Its summary takes
grid rates only, no bisection: each probe would be thousands of generations."""


def perplexity(model, tokens: np.ndarray, window: int = 256, batch: int = 4) -> float:
    """exp(mean NLL) of predicting tokens 1..window-1 of every independent ``window``-token slice of ``tokens``."""
    n = len(tokens) // window
    windows = np.asarray(tokens[: n * window], np.int32).reshape(n, window)
    nll = []
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        logp = jax.nn.log_softmax(model.logits(chunk)[:, :-1], axis=-1)
        nll.append(-np.take_along_axis(np.asarray(logp, np.float64), chunk[:, 1:, None], axis=-1)[..., 0])
    return float(np.exp(np.concatenate(nll).mean()))


class Evaluator:
    """Held-out perplexity and teacher-forced greedy agreement against one uncompressed model."""

    def __init__(self, base, eval_tokens: int, prompts: int, prompt_len: int, new_tokens: int):
        """Held-out tokens and ``base``'s greedy continuations of ``prompts`` prompts, and ``base``'s own scores."""
        ids = np.asarray(base.tokenizer(pydoc_text("heldout"), add_special_tokens=False)["input_ids"])
        need = eval_tokens + prompts * prompt_len
        if len(ids) < need:
            raise ValueError(f"held-out text has {len(ids)} tokens, fewer than the {need} asked for")
        self.ppl_ids = ids[:eval_tokens]
        starts = eval_tokens + np.arange(prompts) * prompt_len
        prompt_ids = [ids[s : s + prompt_len].tolist() for s in starts]
        gen = kvjax.generate(base, prompt_ids, max_new_tokens=new_tokens, max_batch=prompts)
        self.sequences = np.array(
            [p + g.tokens + [0] * (new_tokens - len(g.tokens)) for p, g in zip(prompt_ids, gen, strict=True)], np.int32
        )
        self.lengths = [len(g.tokens) for g in gen]
        self.prompt_len = prompt_len
        self.base = self.score(base)

    def score(self, model) -> dict:
        """{"ppl": held-out perplexity, "agreement": teacher-forced greedy agreement} of ``model``."""
        logits = np.asarray(model.logits(self.sequences))
        hits = total = 0
        for row, n in enumerate(self.lengths):
            pred = logits[row, self.prompt_len - 1 : self.prompt_len - 1 + n].argmax(-1)
            hits += int((pred == self.sequences[row, self.prompt_len : self.prompt_len + n]).sum())
            total += n
        return {"ppl": perplexity(model, self.ppl_ids), "agreement": hits / max(total, 1)}

    def meets(self, s) -> bool:
        """Whether scores ``s`` are within 99% of the baseline (perplexity +1% at most, agreement >= 99%)."""
        return AT_99["ppl"](s["ppl"], self.base["ppl"]) and AT_99["top1"](s["agreement"], self.base["agreement"])


def _calibrate(base, source, num_tokens, seq_len):
    """Calibration statistics of ``base`` on ``num_tokens`` tokens from ``source`` (a ``calibration_tokens`` source)."""
    return calibrate(base, calibration_tokens(base, source, num_tokens, seq_len, seed=0))


def _row(calibration, variant, target, model, scores, base):
    """One result row: the variant, its target and achieved rate, and its scores beside the baseline's."""
    return {
        "calibration": calibration,
        "variant": variant,
        "target_rate": target,
        "rate": model.plan.rate,
        "ppl": scores["ppl"],
        "ppl_change_pct": 100 * (scores["ppl"] / base["ppl"] - 1),
        "agreement": scores["agreement"],
    }


def _variants(base, args, tokens: dict | None = None):
    """(calibration source, variant name, method, adaptive, stats): statistics gathered once per source; its
    calibration tokens go to ``tokens`` (source -> [B, T] ids) if given."""
    for source in args.calibrations:
        ids = calibration_tokens(base, source, args.num_tokens, args.seq_len, seed=0)
        if tokens is not None:
            tokens[source] = ids
        stats = calibrate(base, ids)
        for variant in args.variants:
            yield (source, variant, *VARIANTS[variant], stats)


def variant_plan(base, stats, p, method, adaptive, variant=None, calibration="text", tokens=None, **more):
    """``make_plan`` at target rate ``p`` for ``variant``: its band and Q/K basis from its name, ``more`` as given.
    A "-pick" variant's Q/K basis and widths are those ``compress(qk_basis="measured")`` keeps at this rate
    (``pipeline.pick_qk_basis`` on held-in rows of the ``calibration`` source; ``tokens``, its calibration rows,
    where the source is too short), recorded in the plan."""
    where = dict(target_rate=p, method=method, adaptive=adaptive, band=BANDS.get(variant)) | more
    qk = dict(qk_basis=qk_basis(variant), qk_widths=qk_widths(variant))
    if variant in PICKS:
        widths = adaptive and more.get("sensitivity") is None  # whether F_p reads the widths
        picked = pick_qk_basis(base, stats, calibration, tokens, 0, where, widths)
        qk = dict(zip(("qk_basis", "qk_widths"), picked))
        print(f"{variant} at {p}: picks qk_basis={picked[0]}, qk_widths={picked[1]}", file=sys.stderr, flush=True)
    return make_plan(base, stats, **where, **qk)


def _compressed(base, stats, p, method, adaptive, variant=None, calibration="text"):
    """``base`` compressed to target rate ``p`` by ``method`` (adaptive or uniform ranks; banded by ``variant``)
    from ``stats`` (of the ``calibration`` source)."""
    return fold(base, *variant_plan(base, stats, p, method, adaptive, variant, calibration))


def run_rates(base, ev, args):
    """One row per calibration source, variant and ``--rates`` target."""
    rows = []
    for source, variant, method, adaptive, stats in _variants(base, args):
        for p in args.rates:
            model = _compressed(base, stats, p, method, adaptive, variant, source)
            rows.append(_row(source, variant, p, model, ev.score(model), ev.base))
            print(_fmt(rows[-1]), flush=True)
    return rows


def run_search(base, ev, args):
    """Per variant: bisection on p for the largest rate whose quality is within 99% of the baseline."""
    rows = []
    for source, variant, method, adaptive, stats in _variants(base, args):
        lo, hi, best = 0.0, args.max_rate, None
        for _ in range(args.steps):
            mid = (lo + hi) / 2
            model = _compressed(base, stats, mid, method, adaptive, variant, source)
            row = _row(source, variant, mid, model, ev.score(model), ev.base)
            if ev.meets(row):
                lo, best = max(mid, model.plan.rate), row
            else:
                hi = mid
        rows.append(
            best
            or {
                "calibration": source,
                "variant": variant,
                "target_rate": 0.0,
                "rate": 0.0,
                "ppl": ev.base["ppl"],
                "ppl_change_pct": 0.0,
                "agreement": ev.base["agreement"],
            }
        )
        print(_fmt(rows[-1]), flush=True)
    return rows


def run_stability(base, args):
    """Per calibration token count: mean |R|, mean |R_random - R_text| and their leading half-subspaces' overlap
    (text: the pydoc prose, as the published table was measured)."""
    counts = [c for c in (2048, 4096, 8192, 16384, 32768) if c <= args.max_tokens]
    snaps = {
        src: calibrate(base, calibration_tokens(base, src, counts[-1], args.seq_len, seed=0), snapshots=counts)
        for src in ("random", "prose")
    }
    rows = []
    for count in counts:
        row = {"tokens": count}
        for kind in ("qk", "v"):
            r_rand, r_text = (_rotation(snaps[src][count], kind, base) for src in ("random", "prose"))
            half = r_rand.shape[-1] // 2
            row[f"{kind}_mean_abs_R"] = float(np.abs(r_rand).mean())
            row[f"{kind}_mean_abs_diff"] = float(np.abs(r_rand - r_text).mean())
            # element-wise differences overstate change inside near-degenerate eigenvalue clusters; the overlap of
            # the leading half-subspaces (1 = the same subspace) is what truncation depends on
            overlap = np.linalg.norm(np.swapaxes(r_rand[..., :half], -1, -2) @ r_text[..., :half], axis=(-2, -1))
            row[f"{kind}_half_subspace_overlap"] = float(np.mean(overlap**2 / half))
        rows.append(row)
        print(row, flush=True)
    return rows


def _rotation(stats, kind, model):
    """The orthogonal rotation R of a calibration: ZACK's shared Q/K rotation, or V's principal directions."""
    return stats.basis("qk", model).down if kind == "qk" else principal_axes(stats.grams["v"])[0]


def run_transformers(args):
    """kvjax's perplexity on the reference tokens beside transformers' (from the stored reference)."""
    ref = np.load(REFERENCE)
    model = kvjax.load(args.model, dtype=args.dtype)
    return [
        {"implementation": "kvjax", "dtype": args.dtype, "ppl": perplexity(model, ref["ppl_tokens"])},
        {"implementation": "transformers (GGUF)", "dtype": "float32", "ppl": float(ref["ppl"])},
    ]


def heldout_ids(model, source: str, num_tokens: int | None) -> np.ndarray:
    """The first ``num_tokens`` token ids (all if None) of ``source``'s (``SOURCES``) held-out part."""
    if model.tokenizer is None:
        raise ValueError(f"source {source!r} needs a model with a tokenizer")
    ids = np.asarray(model.tokenizer(SOURCES[source]("heldout"), add_special_tokens=False)["input_ids"])
    if num_tokens is not None and len(ids) < num_tokens:
        raise ValueError(f"{source} heldout text has {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


LOGIT_ROWS = 512  # positions projected onto the vocabulary at a time: [4K, 262K] float32 log-probs are 4 GB each


def log_probs(model, hidden: jax.Array) -> jax.Array:
    """``model``'s next-token log-probs [T, vocab] from its final-norm hidden states [T, E] (``Model.hidden``)."""
    return jax.nn.log_softmax(model.project(hidden), axis=-1)


@jax.jit
def _window_terms(base_logp, logp, targets):
    """Per position: the target's NLL under ``logp``, KL(base || model), and whether both argmaxes agree."""
    kl = jnp.sum(jnp.exp(base_logp) * (base_logp - logp), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return nll, kl, jnp.argmax(base_logp, -1) == jnp.argmax(logp, -1)


def window_sums(base_logp, logp, targets) -> dict:
    """Per-window sums over positions: target NLL, KL(base || model), top-1 agreements, and the position count.

    ``base_logp``/``logp``: [T, vocab] log-probs of the uncompressed and the scored model; ``targets``: [T] ids."""
    nll, kl, agree = (np.asarray(x, np.float64) for x in _window_terms(base_logp, logp, jnp.asarray(targets)))
    return {"nll": float(nll.sum()), "kl": float(kl.sum()), "agree": float(agree.sum()), "n": len(targets)}


def _add(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def _vocab_weights(model) -> list:
    module = model.module
    return [module.embed[...]] + ([] if module.lm_head is None else [module.lm_head.kernel[...]])


def _hidden_for_base(base, model, chunk) -> jax.Array:
    """``model``'s final-norm hidden states [T - 1, E] of ``chunk``, checked projectable by ``base``'s vocabulary
    weights (compression folds only attention weights)."""
    if not all(a is b or bool(jnp.array_equal(a, b)) for a, b in zip(_vocab_weights(base), _vocab_weights(model))):
        raise ValueError("a scored model must share the base model's embedding and output weights")
    return model.hidden(chunk[None])[0, :-1]


def compare_windows(base, builders, ids: np.ndarray, window: int, rows: int = LOGIT_ROWS) -> list[dict]:
    """Perplexity, mean KL(base || model) and top-1 agreement over ``ids``' ``window``-token slices: ``base``'s
    own (KL 0, top-1 1), then each builder's model's.

    ``builders``: zero-argument callables returning the models to score, called once per window, so only one is
    held at a time (its hidden states [window, E] are kept). Log-probs are formed ``rows`` positions at a time
    through ``base``'s vocabulary weights, which every model shares, ``base``'s once per block: memory does not
    grow with window x vocabulary. Each result also holds "per_window": the same three numbers for every window."""
    starts = range(0, len(ids) - window + 1, window)
    if not starts:
        raise ValueError(f"{len(ids)} tokens make no window of {window}")
    sums: list[list[dict]] = [[] for _ in range(len(builders) + 1)]
    for s in starts:
        chunk = np.asarray(ids[s : s + window], np.int32)
        hidden = [base.hidden(chunk[None])[0, :-1]] + [_hidden_for_base(base, build(), chunk) for build in builders]
        totals: list[dict | None] = [None] * len(hidden)
        for r in range(0, window - 1, rows):
            targets = chunk[1:][r : r + rows]
            base_logp, *logps = (log_probs(base, h[r : r + rows]) for h in hidden)
            blocks = [window_sums(base_logp, logp, targets) for logp in (base_logp, *logps)]
            totals = [b if t is None else _add(t, b) for t, b in zip(totals, blocks, strict=True)]
        for acc, total in zip(sums, totals, strict=True):
            acc.append(total)
    return [_scores(acc) | {"per_window": [_scores([w]) for w in acc]} for acc in sums]


def _scores(sums: list[dict]) -> dict:
    """Perplexity, mean KL and top-1 agreement over all positions of ``sums`` (window_sums results)."""
    n = sum(w["n"] for w in sums)
    return {
        "ppl": float(np.exp(sum(w["nll"] for w in sums) / n)),
        "kl": sum(w["kl"] for w in sums) / n,
        "top1": sum(w["agree"] for w in sums) / n,
    }


UNCOMPRESSED = {
    "calibration": "-",
    "variant": "uncompressed",
    "max_context": None,
    "k_share": None,
    "kv_bits": None,
    "target_rate": 0.0,
    "rate": 0.0,
    "overall_rate": 0.0,
    "qk_basis": None,
    "qk_widths": None,
}


def scheme_of(kv: int | str, page_size: int):
    """The ``kv_schemes`` scheme a ``--kv-bits`` value names: a bit width (KIVI-style pages) or a scheme's name."""
    return kv_schemes.Kivi(kv, page_size) if isinstance(kv, int) else kv_schemes.parse(kv, page_size)


class Quantized:
    """``model`` as served from a cache of quantized pages (``kv``: a ``--kv-bits`` value, ``scheme_of``) of
    ``page_size`` tokens: its ``hidden`` is ``model.hidden(tokens, kv=scheme)``; everything else is ``model``'s."""

    def __init__(self, model, kv: int | str, page_size: int):
        self.model, self.scheme = model, scheme_of(kv, page_size)

    def hidden(self, tokens) -> jax.Array:
        return self.model.hidden(tokens, kv=self.scheme)

    def __getattr__(self, name):
        return getattr(self.model, name)


def served(model, kv_bits: int | None, page_size: int):
    """``model``, or it over ``kv_bits``-bit pages (``Quantized``) when ``kv_bits`` is not None."""
    return model if kv_bits is None else Quantized(model, kv_bits, page_size)


def overall_rate(base, plan, kv_bits: int | None, page_size: int) -> float:
    """1 - the cache bytes per token of ``base`` compressed by ``plan`` (None: uncompressed) with ``kv_bits``-bit
    pages of ``page_size`` tokens (every byte of a page: codes, float16 scales and zeros, alignment padding;
    ``token_bytes``) / ``base``'s (uncompressed) bytes per token in bfloat16. Without ``kv_bits``: the plan's rate."""
    if kv_bits is None:
        return 0.0 if plan is None else plan.rate
    layouts = base.layouts if plan is None else [layer_layout(base.config, plan, i) for i in range(plan.num_layers)]
    full = sum(token_bytes(base.layouts, jnp.bfloat16).values())
    return 1.0 - sum(kv_schemes.token_bytes(scheme_of(kv_bits, page_size), layouts).values()) / full


def uncompressed_row(base, kv_bits, page_size: int) -> dict:
    """The fields of ``base`` itself served over ``kv_bits``-bit pages (None: unquantized), its honest rate beside."""
    return UNCOMPRESSED | {"kv_bits": kv_bits, "overall_rate": overall_rate(base, None, kv_bits, page_size)}


def qk_fields(plan) -> dict:
    """A row's Q/K basis and the spectrum its widths came from, as the plan records them ("shared" where it stores
    None); None for Palu's pre-RoPE plans and the uncompressed model. A -pick variant's rows say what it picked."""
    if plan is None or plan.method != "zack":
        return {"qk_basis": None, "qk_widths": None}
    return {"qk_basis": plan.qk_basis or "shared", "qk_widths": plan.qk_widths or "shared"}


def _build(base, plan, bases, kv_bits: int | None, page_size: int):
    """The model a row scores: ``base`` folded by ``plan`` (None: ``base`` itself), served over ``kv_bits``-bit
    pages of ``page_size`` tokens if ``kv_bits``."""
    return served(base if plan is None else fold(base, plan, bases), kv_bits, page_size)


def _groups(base, args):
    """(group fields, plan_for) per calibration, variant, zack ``--max-context``, ``--k-share`` and ``--kv-bits``;
    ``plan_for(p)`` gives (row fields, plan, bases) at target rate ``p`` (folding waits)."""
    tokens: dict = {}
    for source, variant, method, adaptive, stats in _variants(base, args, tokens):
        for max_context in args.max_context if method == "zack" and variant not in BANDS else [None]:
            sensitivity = None
            if variant in MEASURED:  # probed once per group, reused by every rate
                where = dict(method=method, max_context=max_context, band=BANDS.get(variant))
                where["qk_basis"] = qk_basis(variant)
                sensitivity = measure_sensitivity(base, stats, source, tokens[source], **where)
            for k_share in args.k_share if variant not in MEASURED else [None]:
                for bits in args.kv_bits:
                    group = {"calibration": source, "variant": variant, "max_context": max_context}
                    group |= {"k_share": k_share, "kv_bits": bits}

                    def plan_for(p, group=group, stats=stats, method=method, adaptive=adaptive, sens=sensitivity):
                        more = dict(max_context=group["max_context"], k_share=group["k_share"], sensitivity=sens)
                        more |= dict(calibration=group["calibration"], tokens=tokens[group["calibration"]])
                        plan, bases = variant_plan(base, stats, p, method, adaptive, group["variant"], **more)
                        overall = overall_rate(base, plan, group["kv_bits"], args.kv_page)
                        row = group | {"target_rate": p, "rate": plan.rate, "overall_rate": overall}
                        return row | qk_fields(plan), plan, bases

                    yield group, plan_for


def _eval_plans(base, args):
    """(row fields, plan, bases) per model group (``_groups``) and ``--rates`` target."""
    return [plan_for(p) for _, plan_for in _groups(base, args) for p in args.rates]


def largest_passing(
    probe: Callable[[float], object],
    grid,
    passes: Callable[[object], bool],
    steps: int,
    upper: float,
) -> tuple[float, object]:
    """The largest rate whose ``probe(rate)`` ``passes``, and that probe (0.0 and None when none passes): the bracket
    from ``grid``, then ``steps`` bisections of it.

    The bracket runs from the largest grid rate passing with every smaller one passing (0.0 when the smallest fails)
    to the next grid rate (``upper`` when all pass; no bisection when ``upper`` is not above the lower end)."""
    lo, found, hi = 0.0, None, upper
    for rate in sorted(set(grid)):
        result = probe(rate)
        if not passes(result):
            hi = rate
            break
        lo, found = rate, result
    for _ in range(steps if hi > lo else 0):
        mid = (lo + hi) / 2
        result = probe(mid)
        if passes(result):
            lo, found = mid, result
        else:
            hi = mid
    return lo, found


def cached(evaluate: Callable[[float], object], known: dict | None = None) -> Callable[[float], object]:
    """``evaluate`` run at most once per rate: rates in ``known`` (rate -> result) and rates asked before answer from
    the cache (the returned callable's ``results``)."""
    results = dict(known or {})

    def probe(rate: float):
        if rate not in results:
            results[rate] = evaluate(rate)
        return results[rate]

    probe.results = results
    return probe


def _score(base, heldout: dict, windows, models, base_rows: dict, page_size: int = PAGE_TOKENS) -> list[dict]:
    """Rows of every (row fields, plan, bases) of ``models`` per source and window, one ``compare_windows`` pass a
    window; the uncompressed model's rows go to ``base_rows`` ((source, window) -> row) the first time. A plan of
    None scores ``base`` itself; row fields' "kv_bits" (if not None) serve the model over pages of ``page_size``."""
    builders = [
        functools.partial(_build, base, plan, bases, fields["kv_bits"], page_size) for fields, plan, bases in models
    ]
    rows = []
    for source, ids in heldout.items():
        for window in windows:
            own, *scores = compare_windows(base, builders, ids, window)
            head = {"source": source, "window": window, "tokens": len(ids) // window * window}
            if (source, window) not in base_rows:
                base_rows[(source, window)] = head | UNCOMPRESSED | {"probe": False} | own
                print(_fmt(_shown(base_rows[(source, window)])), flush=True)
            for (fields, _, _), sc in zip(models, scores, strict=True):
                rows.append(head | fields | sc)
                print(_fmt(_shown(rows[-1])), flush=True)
    return rows


def _same_plan(plan) -> tuple:
    """What makes two plans of one group fold to the same model: their widths and head order."""
    order = None if plan.head_order is None else plan.head_order.tobytes()
    return plan.k_qk.tobytes(), plan.k_v.tobytes(), order


def _at_99(
    base, heldout: dict, args, group: dict, plan_for, models: list, grid_rows: list[dict], base_rows: dict, rows
):
    """Per source and metric (``AT_99``) on the longest window: ``group``'s largest target rate at 99% of baseline
    (``largest_passing`` from its grid ``models``' ``grid_rows`` and ``--bisect-steps`` probes, each target rate
    evaluated once and each plan scored once). Probe rows (marked "probe") go to ``rows``."""
    longest = max(args.windows)

    def at_longest(new_rows):
        return {r["source"]: r for r in new_rows if r["window"] == longest}

    known = {}
    evaluated: dict[tuple, list[dict]] = {}  # a plan already scored (the same widths): its rows
    for fields, plan, _ in models:
        mine = {(r["source"], r["window"]): r for r in grid_rows if r["target_rate"] == fields["target_rate"]}
        evaluated[_same_plan(plan)] = list(mine.values())
        known[fields["target_rate"]] = at_longest(mine.values())

    def evaluate(target: float):
        try:
            fields, plan, bases = plan_for(target)
        except ValueError as e:  # a rate the plan cannot reach (say, a --k-share too small for it) fails
            print(f"probe at target rate {target:.6g} fails: {e}", file=sys.stderr, flush=True)
            return None
        fields |= {"probe": True}
        key = _same_plan(plan)
        if key in evaluated:
            new = [r | fields for r in evaluated[key]]
            for r in new:
                print(_fmt(_shown(r)), flush=True)
        else:
            new = evaluated[key] = _score(base, heldout, args.windows, [(fields, plan, bases)], base_rows, args.kv_page)
        rows.extend(new)
        return at_longest(new)

    probe = cached(evaluate, known)
    out = []
    for source in heldout:
        base_row = base_rows[(source, longest)]
        for metric, test in AT_99.items():

            def passes(result, source=source, metric=metric, test=test, base_value=base_row[metric]):
                return result is not None and test(result[source][metric], base_value)

            target, result = largest_passing(probe, list(known), passes, args.bisect_steps, args.max_rate)
            there = result[source] if result is not None else base_row
            entry = group | {"source": source, "window": longest, "metric": metric}
            out.append(entry | {"target_rate": target, "rate": there["rate"], "overall_rate": there["overall_rate"]})
            out[-1]["value"] = there[metric]
            out[-1]["base"] = base_row[metric]
            print(_fmt(out[-1]), flush=True)
    return out


def run_eval(base, args, heldout: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Rows per source, window and model (the uncompressed model's first, then over each ``--kv-bits`` pages, then
    per model group its ``--rates`` and ``--bisect-steps`` probes) and the at-99% entries (``_at_99``); ``--json`` is
    rewritten after every group.

    ``heldout``: token ids per source (default: ``--eval-tokens`` of each ``--sources`` held-out text)."""
    tokens = args.eval_tokens or 8192
    if heldout is None:
        heldout = {source: heldout_ids(base, source, tokens) for source in args.sources}
    base_rows: dict = {}
    rows: list[dict] = []
    at_99: list[dict] = []
    quantized = [  # the uncompressed model over quantized pages ("4-bit alone"), beside its unquantized rows
        (uncompressed_row(base, bits, args.kv_page), None, None) for bits in args.kv_bits if bits is not None
    ]
    if quantized:
        models = [(fields | {"probe": False}, plan, bases) for fields, plan, bases in quantized]
        rows += _score(base, heldout, args.windows, models, base_rows, args.kv_page)
        if args.json:
            write_json(args.json, _eval_json(args, [*base_rows.values(), *rows], at_99, complete=False), indent=1)
    for group, plan_for in _groups(base, args):
        models = [plan_for(p) for p in args.rates]
        models = [(fields | {"probe": False}, plan, bases) for fields, plan, bases in models]
        grid_rows = _score(base, heldout, args.windows, models, base_rows, args.kv_page)
        rows += grid_rows
        if args.bisect_steps:
            at_99 += _at_99(base, heldout, args, group, plan_for, models, grid_rows, base_rows, rows)
        if args.json:
            write_json(args.json, _eval_json(args, [*base_rows.values(), *rows], at_99, complete=False), indent=1)
    return [*base_rows.values(), *rows], at_99


def _eval_json(args, rows: list[dict], at_99: list[dict], complete: bool) -> dict:
    """The JSON of an eval run so far: its arguments, every row (probes too) and the at-99% entries."""
    return {"mode": "eval", "args": vars(args), "rows": rows, "complete": complete, "at_99": at_99}


def run_retrieval(base, args) -> tuple[list[dict], list[dict]]:
    """Retrieval per task and model (uncompressed, then per model group and rate, ``_eval_plans``): table
    rows (one per context: accuracy per depth, their mean and its change from the uncompressed model's) and every
    run's ``retrieval.run`` results. Each compressed model is folded once and serves every task and context."""
    models = [(uncompressed_row(base, bits, args.kv_page), lambda: base) for bits in args.kv_bits]
    models += [(row, functools.partial(fold, base, plan, bases)) for row, plan, bases in _eval_plans(base, args)]
    runs: list[dict] = []
    for fields, build in models:
        model = build()
        results = retrieval.run(
            model,
            args.task,
            args.contexts,
            args.depths,
            args.trials,
            seed=args.seed,
            max_batch=args.max_batch,
            max_new_tokens=args.answer_tokens,
            chunk_tokens=args.chunk_tokens,
            backend=args.backend,
            kv_bits=fields["kv_bits"],
            # a GEAR name's -p<tokens> fixes its page; otherwise --kv-page
            page_size=(kv_schemes.page_of(fields["kv_bits"]) or args.kv_page)
            if fields["kv_bits"] is not None
            else None,
        )
        for task in args.task:
            runs.append(fields | {"task": task, "results": results[task]})
            for row in _retrieval_rows(runs[-1:], runs):
                print(_fmt(row), flush=True)
            if args.png_dir:
                _retrieval_heatmap(runs[-1], args)
        model.release_cache()  # not needed again: free its KV cache before the next model's
        del model
        if args.json:
            write_json(args.json, _retrieval_json(args, runs, complete=False), indent=1)
    return _retrieval_rows(runs, runs), runs


def _retrieval_rows(runs: list[dict], everything: list[dict]) -> list[dict]:
    """One row per run of ``runs`` and context: accuracy per depth, their mean, and the mean's change from the
    uncompressed model's on the same task and context (its run is found among ``everything``)."""
    base_mean = {
        (r["task"], context): float(np.mean([c["accuracy"] for c in r["results"]["cells"] if c["context"] == context]))
        for r in everything
        if r["variant"] == "uncompressed" and r["kv_bits"] is None
        for context in r["results"]["contexts"]
    }
    rows = []
    for run in runs:
        results = run["results"]
        cells = retrieval.accuracy(results)
        for context in results["contexts"]:
            depths = {f"depth {d:g}": cells[(context, d)] for d in results["depths"]}
            mean = float(np.mean(list(depths.values())))
            row = {"task": run["task"]} | {k: run[k] for k in UNCOMPRESSED} | {"context": context} | depths
            rows.append(row | {"mean": mean, "vs_base": mean - base_mean[(run["task"], context)]})
    return rows


def within_tolerance(runs: list[dict], tolerance: float) -> list[dict]:
    """Per model group, task and context of ``runs``: the largest grid target rate whose mean accuracy over depths
    is at least the uncompressed model's minus ``tolerance`` with every smaller grid rate's too (0.0 when none is)."""
    rows = _retrieval_rows(runs, runs)
    base_mean = {
        (r["task"], r["context"]): r["mean"] for r in rows if r["variant"] == "uncompressed" and r["kv_bits"] is None
    }
    grids: dict[tuple, dict[float, dict]] = {}
    for row in rows:
        if row["variant"] != "uncompressed":
            key = (*(row[k] for k in GROUP), row["task"], row["context"])
            grids.setdefault(key, {})[row["target_rate"]] = row
    out = []
    for key, grid in grids.items():
        base = base_mean[key[-2:]]

        def passes(row, base=base):
            return row["mean"] >= base - tolerance - 1e-9  # accuracies are fractions of trials: forgive rounding

        target, row = largest_passing(grid.__getitem__, list(grid), passes, steps=0, upper=0.0)
        entry = dict(zip((*GROUP, "task", "context"), key, strict=True)) | {"target_rate": target}
        out.append(entry | {"rate": row["rate"] if row else 0.0, "mean": row["mean"] if row else base, "base": base})
    return out


def _retrieval_heatmap(run: dict, args) -> None:
    """Write ``run``'s heat map to ``--png-dir``, named and titled by its task, variant, calibration and rate."""
    if not run["results"]["contexts"]:
        return
    name = f"{run['task']}-{run['variant']}"
    title = f"{args.model}: {run['task']}, {run['variant']}"
    if run["kv_bits"] is not None:
        name += f"-int{run['kv_bits']}"
        title += f", int{run['kv_bits']} pages"
    if run["variant"] != "uncompressed":
        name += f"-{run['calibration']}-p{run['target_rate']:g}"
        title += f" p={run['rate']:.3f} ({run['calibration']} calibration"
        if run["max_context"] is not None:
            name += f"-ctx{run['max_context']}"
            title += f", max_context {run['max_context']}"
        if run["k_share"] is not None:
            name += f"-k{run['k_share']:g}"
            title += f", Q/K share {run['k_share']:g}"
        title += ")"
    retrieval.heatmap(run["results"], os.path.join(args.png_dir, name.replace(os.sep, "_") + ".png"), title)


def _retrieval_json(args, runs: list[dict], complete: bool) -> dict:
    """The JSON of a retrieval run so far: its arguments, table rows, the within-tolerance summary
    (``within_tolerance``) and every run's results."""
    rows, summary = _retrieval_rows(runs, runs), within_tolerance(runs, args.retrieval_tolerance)
    return {
        "mode": "retrieval",
        "args": vars(args),
        "rows": rows,
        "within_tolerance": summary,
        "complete": complete,
        "runs": runs,
    }


def _shown(row) -> dict:
    """``row`` without its per-window lists (the JSON keeps them)."""
    return {k: v for k, v in row.items() if k != "per_window"}


def _fmt(row) -> str:
    """A row's values joined by " | " (floats to 4 places, None as "-")."""
    return " | ".join("-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values())


def table(rows) -> str:
    """Rows as a markdown table."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    lines += ["| " + _fmt(r) + " |" for r in rows]
    return "\n".join(lines)


def _positive(value: str) -> int:
    """A positive integer argument."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def _max_context(value: str) -> int | None:
    """``--max-context`` values: a positive integer, or "none" (the basis of the positions calibration saw)."""
    if value.lower() == "none":
        return None
    try:
        return _positive(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'none', got {value!r}") from None


def _kv_bits(value: str) -> int | str | None:
    """``--kv-bits`` values: a width kvjax quantizes pages to (``kvjax.ops.quant.BITS``: KIVI-style), a scheme of
    ``kvjax.ops.kv_schemes`` by name (gear4, gear2 with optional -r<rank> -o<outliers>, zipcache[-paged|-separable]),
    or "none"
    (unquantized)."""
    if value.lower() == "none":
        return None
    if value in [str(b) for b in BITS]:
        return int(value)
    if value.lower().startswith(("gear", "zipcache")):
        try:
            return kv_schemes.parse(value).name  # its canonical name: "gear2-r2" is "gear2"
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    raise argparse.ArgumentTypeError(
        f"must be {', '.join(map(str, BITS))}, gear4, gear2, zipcache or 'none', got {value!r}"
    )


def _non_negative(value: str) -> int:
    """A non-negative integer argument."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value!r}")
    return n


def _fraction(value: str) -> float:
    """A number in [0, 1] (``--depths``, ``--retrieval-tolerance``)."""
    try:
        share = float(value)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value!r}")
    return share


def parser() -> argparse.ArgumentParser:
    """Every mode's flags."""
    p = argparse.ArgumentParser(
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=("rates", "search", "stability", "transformers", "eval", "retrieval"))
    p.add_argument("--model", default="smollm2", help="model path or 'smollm2' (default)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.375, 0.5])
    p.add_argument(
        "--variants",
        nargs="+",
        default=DEFAULT_VARIANTS,
        choices=list(VARIANTS),
        help="ZACK adaptive and uniform, Palu adaptive and uniform (default), banded ZACK (zack-band16/32/64, and "
        "1/4 as diagnostics: keys in the frame of their band of W positions; every position served, so --max-context "
        "does not apply); -measured: ranks by measured effect; -pair: queries and keys on a score-aware pair "
        "(compress(qk_basis='pair'))",
    )
    p.add_argument(
        "--calibrations",
        nargs="+",
        default=["random", "text"],
        help="calibration sources: random, text (prose and code), prose, code or text:PATH (default: random text)",
    )
    p.add_argument("--num-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration sequence length (default 512)")
    p.add_argument(
        "--eval-tokens", type=_positive, default=None, help="held-out tokens (default 4096; eval: 8192 per source)"
    )
    p.add_argument("--prompts", type=int, default=8, help="agreement prompts N (default 8)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="agreement tokens per prompt M (default 32)")
    p.add_argument(
        "--max-rate",
        type=float,
        default=0.75,
        help="search, eval --bisect-steps: the rate's upper bound (default 0.75)",
    )
    p.add_argument("--steps", type=int, default=6, help="search bisection steps (default 6)")
    p.add_argument("--max-tokens", type=int, default=32768, help="stability: largest token count")
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES), help="eval: held-out text")
    p.add_argument(
        "--windows", type=_positive, nargs="+", default=[1024, 4096], help="eval: window lengths (default 1024 4096)"
    )
    p.add_argument(
        "--max-context",
        type=_max_context,
        nargs="+",
        default=[None],
        metavar="N",
        help="eval, retrieval: zack plans' max_context, one row each (N or 'none', the default); palu ignores it",
    )
    p.add_argument(
        "--k-share",
        type=validate.share_arg({"none": None}),
        nargs="+",
        default=[None],
        metavar="S",
        help="eval, retrieval: Q/K's share of the columns a rate keeps, one row each (S in (0, 1) or 'none', the "
        "default: one removal rate for both)",
    )
    p.add_argument(
        "--kv-bits",
        type=_kv_bits,
        nargs="+",
        default=[None],
        metavar="B",
        help="eval and retrieval: score every model also over a cache of B-bit quantized pages, one model group "
        f"each (B: {', '.join(map(str, BITS))} for KIVI-style pages, gear4 or gear2 for GEAR's low-rank and outlier "
        "terms on them (kvjax.ops.gear, the reference's streaming settings; -r<rank> and -o<outlier share> change "
        "them, e.g. gear2-r1-o0.005), zipcache for 4/2 bits by saliency (kvjax.ops.zipcache; zipcache-paged "
        "ranges keys a page of a precision class at a time, zipcache-separable per token), or 'none', the default: "
        "unquantized)",
    )
    p.add_argument(
        "--kv-page",
        type=_positive,
        default=PAGE_TOKENS,
        metavar="T",
        help=f"--kv-bits: tokens a quantized page (default {PAGE_TOKENS})",
    )
    p.add_argument(
        "--bisect-steps",
        type=_non_negative,
        default=0,
        metavar="N",
        help="eval: per model group, source and metric (ppl, top1) on the longest window, bisect N times for the "
        "largest rate at 99%% of baseline, from the --rates grid's bracket up to --max-rate (default 0: off)",
    )
    p.add_argument(
        "--retrieval-tolerance",
        type=_fraction,
        default=0.02,
        metavar="T",
        help="retrieval: summarise the largest --rates target whose mean accuracy is at least the uncompressed "
        "model's minus T (default 0.02: 2 points); grid rates only, no bisection (a probe is thousands of "
        "generations)",
    )
    p.add_argument(
        "--task",
        nargs="+",
        default=list(retrieval.TASKS),
        choices=retrieval.TASKS,
        help="retrieval: tasks (default: both)",
    )
    p.add_argument(
        "--contexts",
        type=_positive,
        nargs="+",
        default=[1024, 2048, 4096, 8192],
        help="retrieval: prompt lengths in tokens (default 1024 2048 4096 8192)",
    )
    p.add_argument(
        "--depths",
        type=_fraction,
        nargs="+",
        default=list(retrieval.DEPTHS),
        help="retrieval: key depths, fractions of the filler (default 0 0.25 0.5 0.75 1)",
    )
    p.add_argument("--trials", type=_positive, default=50, help="retrieval: prompts per context and depth (default 50)")
    p.add_argument(
        "--seed",
        type=validate.arg(validate.seed, int),
        default=0,
        help="retrieval: seed of the trials' keys (default 0)",
    )
    p.add_argument("--answer-tokens", type=_positive, default=8, help="retrieval: tokens generated (default 8)")
    p.add_argument("--max-batch", type=_positive, default=16, help="retrieval: sequences at once (default 16)")
    p.add_argument(
        "--chunk-tokens", type=_positive, default=512, help="retrieval: prompt tokens prefilled a step (default 512)"
    )
    p.add_argument(
        "--backend",
        choices=("pallas", "reference", "interpret"),
        default=None,
        help="retrieval: attention path (default: kvjax's for this machine)",
    )
    p.add_argument("--png-dir", default=None, help="retrieval: write a heat map per task, variant and rate here")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    return p


def _check_eval(p, args, base) -> None:
    """Refuse eval flags the model or the held-out tokens cannot serve, naming the flag."""
    context = base.config.max_position_embeddings
    if max(args.windows) > context:
        p.error(f"--windows {max(args.windows)} exceeds the model's context of {context} tokens")
    if min(args.windows) < 2:
        p.error("--windows must be at least 2 tokens (one prediction)")
    if (args.eval_tokens or 8192) < max(args.windows):
        p.error(f"--eval-tokens {args.eval_tokens} is fewer than the longest --windows {max(args.windows)}")
    if args.bisect_steps and not 0.0 < args.max_rate < 1.0:
        p.error(f"--max-rate must lie strictly between 0 and 1 for --bisect-steps, got {args.max_rate}")
    _check_outputs(p, args)


def _check_kv_bits(p, args) -> None:
    """Refuse --kv-bits outside eval, repeated, or with Palu or banded variants (before any model loads)."""
    if len(set(args.kv_bits)) < len(args.kv_bits):
        p.error(f"--kv-bits values must be distinct, got {' '.join(str(b).lower() for b in args.kv_bits)}")
    if args.kv_bits == [None]:
        return
    if args.mode not in ("eval", "retrieval"):
        p.error("--kv-bits applies to eval and retrieval only")
    if args.mode == "retrieval" and any(str(b).startswith("zipcache") for b in args.kv_bits):
        p.error(
            f"retrieval --kv-bits {' '.join(str(b).lower() for b in args.kv_bits)}: the engine serves KIVI-style "
            f"({', '.join(map(str, BITS))}) and GEAR pages; ZipCache is scored by eval only (teacher-forced)"
        )
    rebuilt = [v for v in args.variants if VARIANTS[v][0] == "palu" or v in BANDS]
    if any(b is not None for b in args.kv_bits) and rebuilt:
        p.error(
            f"--kv-bits {' '.join(str(b).lower() for b in args.kv_bits)}: quantized pages serve plain ZACK and "
            f"uncompressed models only, not {' '.join(rebuilt)} (their K is rebuilt as it is read); pass --variants "
            "zack or zack-uniform"
        )


def _check_retrieval(p, args, base) -> None:
    """Refuse retrieval flags the model cannot serve or outputs that cannot be written, naming the flag."""
    if base.tokenizer is None:
        p.error("retrieval needs a model with a tokenizer")
    for flag, values in (("--task", args.task), ("--contexts", args.contexts), ("--depths", args.depths)):
        if len(set(values)) < len(values):
            p.error(f"{flag} values must be distinct, got {' '.join(map(str, values))}")
    rng = np.random.default_rng(0)
    for task in args.task:
        try:
            retrieval.build_prompt(task, base.tokenizer, min(args.contexts), 0.5, rng)
        except ValueError as e:
            p.error(f"--contexts {min(args.contexts)}: {e}")
    _check_outputs(p, args)


def _check_outputs(p, args) -> None:
    """Refuse a --json whose folder cannot be written and a --png-dir that cannot be made or written."""
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--json {args.json}: {folder} is not a writable directory")
    if args.png_dir:
        try:
            os.makedirs(args.png_dir, exist_ok=True)
        except OSError as e:
            p.error(f"--png-dir {args.png_dir}: {e.strerror}")
        if not os.access(args.png_dir, os.W_OK):
            p.error(f"--png-dir {args.png_dir} is not writable")


def main(argv=None):
    """The command line: one mode's rows, printed as a table and optionally written as JSON."""
    p = parser()
    args = p.parse_args(argv)
    if args.bisect_steps and args.mode != "eval":
        p.error(
            "--bisect-steps applies to eval only (retrieval summarises its --rates grid: each probe would be "
            "thousands of generations)"
        )
    _check_kv_bits(p, args)
    if args.mode not in ("eval", "retrieval") and MEASURED & set(args.variants):
        p.error(f"--variants {' '.join(sorted(MEASURED & set(args.variants)))}: eval and retrieval only")
    # float32 means float32 on every device: JAX's GPU default computes float32 dots in TF32 (10-bit mantissas), so
    # the same command gave other retrieval answers on an H100 than on the CPU (bench/results/quantization.md "Retrieval
    # at 4K and 8K with quantized pages (SmolLM2, H100)")
    jax.config.update("jax_default_matmul_precision", "highest")

    start = time.time()
    extra: dict = {}
    summary = ""
    if args.mode == "transformers":
        rows = run_transformers(args)
    else:
        base = kvjax.load(args.model, dtype=args.dtype)
        if args.mode == "stability":
            rows = run_stability(base, args)
        elif args.mode == "eval":
            _check_eval(p, args, base)
            rows, at_99 = run_eval(base, args)
            extra = {"complete": True, "at_99": at_99}
            if args.bisect_steps:
                summary = f"\n\nlargest rate at 99% of baseline\n\n{table(at_99)}"
        elif args.mode == "retrieval":
            _check_retrieval(p, args, base)
            rows, runs = run_retrieval(base, args)
            tolerance = within_tolerance(runs, args.retrieval_tolerance)
            extra = {"within_tolerance": tolerance, "complete": True, "runs": runs}
            summary = f"\n\nlargest rate within {100 * args.retrieval_tolerance:g} points of base\n\n{table(tolerance)}"
        else:
            ev = Evaluator(base, args.eval_tokens or 4096, args.prompts, args.prompt_len, args.new_tokens)
            print(f"uncompressed: perplexity {ev.base['ppl']:.4f}, agreement {ev.base['agreement']:.4f}", flush=True)
            rows = (run_rates if args.mode == "rates" else run_search)(base, ev, args)
            rows.insert(
                0,
                {
                    "calibration": "-",
                    "variant": "uncompressed",
                    "target_rate": 0.0,
                    "rate": 0.0,
                    "ppl": ev.base["ppl"],
                    "ppl_change_pct": 0.0,
                    "agreement": ev.base["agreement"],
                },
            )
    shown = table([_shown(r) for r in rows])
    pages = f", quantized pages of {args.kv_page} tokens" if any(b is not None for b in args.kv_bits) else ""
    print(f"\n{args.mode} on {args.model} ({args.dtype}{pages}), {time.time() - start:.0f} s\n\n{shown}{summary}")
    if args.json:
        write_json(args.json, {"mode": args.mode, "args": vars(args), "rows": rows} | extra, indent=1)


if __name__ == "__main__":
    main()
