"""Eviction's accuracy, alone and stacked on rank reduction (issue 37): each method at token budgets per KV head and
at compression ratios, on the uncompressed model and on compressed plans, teacher-forced (``kvjax.eviction.reference``).

Mode ``eval``: held-out prose and code (``accuracy.SOURCES``) in windows of ``--windows`` tokens. Each window's first
tokens are the prompt, prefilled exactly and then cut per head by the policy; its last ``--continuation`` tokens are
decoded over what was kept and are the ones scored: perplexity, KL(base || model) and top-1 agreement against the
uncompressed model on the same positions. ``overall_rate`` is 1 - the kept prompt's cache bytes (each head at its
own width) over the uncompressed prompt's (``reference.kept_bytes``), averaged over windows; a plan without
eviction has its own rate. The summary gives, per source and method, the largest overall rate whose perplexity
stays within 1% of the uncompressed model's, alone and on each stack under it (a plan, quantized pages, both).

``--kv-bits`` adds every model (the uncompressed one too) served from quantized pages of ``--page-size`` tokens,
one page format for both: each head's survivors compacted, then quantized (``reference.compacted_round_trip``: the
engine's cut at a prompt's end, made in full-precision staging before the pages are written). Its overall rate
counts the pages' codes, scales and zeros (``kv_schemes.token_bytes``, per layer). ``--group-cuts`` adds each of
those models cut instead by whole groups of ``--page-size`` positions (``reference.group_cut``), as continual
eviction cuts a sequence whose pages are already quantized (``continual.compress_groups``: observation-window
methods only): the same count a head, rounded up to whole groups, and no group quantized again. Its rows say
"groups" in ``cut``; the summary gives them a stack of their own.

Mode ``retrieval``: the passkey and multi-key prompts of ``retrieval``, their answers teacher-forced: a trial is
right when the greedy choice at every answer position is the answer's token (then greedy decoding writes the
answer; the engine's ``accuracy.py retrieval`` scores the same trials by their generated text). The prompt is cut
once after prefill, as the methods publish it; the question at its end is in every observation window. With
``--served``, the engine generates the answers instead (``kvjax.generate`` with ``eviction=`` and each ``--kv-bits``,
every trial of a context in one batched call), scored by their text, the rate nominal (the plan's bytes, on quantized
pages the pages', over the ratio).

Scores are computed once per (plan, window), every method from one forward and one compile, and reused by every
budget and page format. Results: bench/results/eviction.md "Eviction: accuracy"."""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import numpy as np

import kvjax
from bench import accuracy, retrieval
from bench.files import write_json
from kvjax.compression import calibrate, calibration_tokens, fold, make_plan
from kvjax.compression.pipeline import measure_sensitivity
from kvjax.eviction import Eviction, metrics
from kvjax.eviction import parse as parse_eviction
from kvjax.eviction.reference import group_cut, hidden_after, keep, kept_bytes, scores_and_prefix
from kvjax.ops.quant import GROUP

ANSWER_ROOM = 16  # retrieval: positions past the prompt a plan's basis covers (the answer's tokens)
EPILOG = """examples:
  python -m bench.eviction eval --model smollm2 --windows 4096 --continuation 1024 \\
      --methods kvcompress snapkv h2o keyformer --budgets 128 256 512 1024 --ratios 2 4 8 --plans none zack:0.5
  python -m bench.eviction retrieval --task passkey multikey --contexts 4096 8192 --trials 4 \\
      --methods kvcompress --ratios 8 --plans none zack:0.5

--plans: "none" (the uncompressed model) or VARIANT:RATE with a variant of accuracy.py (zack, zack-band16, palu,
...), calibrated once on --calibration text; --kv-bits 4 (or 2, gear2, ...) serves each also from quantized pages
(plain ZACK and uncompressed plans only). Policies: every --methods with every --budgets (tokens per KV head)
and every --ratios (prompt tokens over the ratio), plus "none"; --evict adds policies in their short form
("kvcompress:4x:uniform"). KV-Compress allocates one budget across all heads and layers, the others the same budget
to every head (kvjax.eviction.select)."""


def _plan_arg(value: str) -> tuple[str, float] | None:
    """A ``--plans`` entry: "none" or VARIANT:RATE."""
    if value.lower() == "none":
        return None
    variant, _, rate = value.partition(":")
    try:
        p = float(rate)
    except ValueError:
        p = -1.0
    if variant not in accuracy.VARIANTS or not 0.0 <= p < 1.0:
        names = sorted(accuracy.VARIANTS)
        raise argparse.ArgumentTypeError(f"must be 'none' or VARIANT:RATE (VARIANT one of {names}), got {value!r}")
    return variant, p


def _evict_arg(value: str) -> Eviction:
    try:
        return parse_eviction(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ratio_arg(value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        r = 0.0
    if not r >= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {value!r}")
    return r


def policies(args) -> list[Eviction | None]:
    """None (no eviction) and each method at each budget and ratio, then ``--evict``'s, with ``--page-size``."""
    out: list[Eviction | None] = [None]
    for method in args.methods:
        out += [Eviction(method, budget=b, page_size=args.page_size) for b in args.budgets]
        out += [Eviction(method, ratio=r, page_size=args.page_size) for r in args.ratios]
    return out + list(args.evict)


def plan_models(base, args, max_context: int) -> list[tuple[dict, object]]:
    """(fields, model) per ``--plans`` entry: the uncompressed model, and each plan folded from one calibration; a
    plain ZACK plan's Q/K basis covers ``max_context`` positions. A ``-measured`` variant's ranks come from each
    head's probed effect (``measure_sensitivity``: two forwards a head), probed once and reused by its every rate."""
    stats, ids, measured = None, None, {}
    out = []
    for entry in args.plans:
        if entry is None:
            out.append(({"plan": "none", "rate": 0.0}, base))
            continue
        variant, p = entry
        if stats is None:
            ids = calibration_tokens(base, args.calibration, args.num_tokens, args.seq_len, seed=0)
            stats = calibrate(base, ids)
        method, adaptive = accuracy.VARIANTS[variant]
        band = accuracy.BANDS.get(variant)
        # a plain ZACK basis fits the positions it will serve (make_plan's default fits the calibration rows' 512)
        where = dict(method=method, band=band, max_context=max_context if method == "zack" and band is None else None)
        where["qk_basis"] = accuracy.qk_basis(variant)
        if variant in accuracy.MEASURED and variant not in measured:
            measured[variant] = measure_sensitivity(base, stats, args.calibration, ids, **where)
            _progress(f"{variant}: every head probed")
        plan, bases = make_plan(
            base, stats, target_rate=p, adaptive=adaptive, sensitivity=measured.get(variant), **where
        )
        model = fold(base, plan, bases)
        out.append(({"plan": f"{variant}:{p:g}", "rate": model.plan.rate}, model))
        _progress(f"plan {variant}:{p:g} built")
    return out


def served_models(base, args, models) -> list[tuple[dict, object, object]]:
    """(fields, model, scheme) per plan and ``--kv-bits`` entry: the scheme None (unquantized) or the
    ``kv_schemes`` scheme its pages use, ``--page-size`` tokens a page; fields name the pair ("zack:0.5 kv4") and give
    its overall rate (``accuracy.overall_rate``) and how a policy cuts it (``cut``: "slots", or with ``--group-cuts``
    a second entry of each quantized pair, "zack:0.5 kv4 groups", cut by whole groups)."""
    out = []
    for (fields, model), kv in itertools.product(models, args.kv_bits):
        rate = accuracy.overall_rate(base, model.plan, kv, args.page_size) if kv is not None else fields["rate"]
        name = fields["plan"] if kv is None else f"{fields['plan']} kv{kv}"
        scheme = None if kv is None else accuracy.scheme_of(kv, args.page_size)
        pair = fields | {"name": name, "kv_bits": kv, "plan_rate": fields["rate"], "rate": rate, "cut": "slots"}
        for cut in ["slots", "groups"] if kv is not None and args.group_cuts else ["slots"]:
            named = pair if cut == "slots" else pair | {"name": f"{name} {cut}", "cut": cut}
            out.append((named, model, scheme))
    return out


def _everything(model, prompt: int, rows: int = 1) -> list[np.ndarray]:
    """A selection that keeps every prompt token of every head (a plan served without eviction)."""
    return [np.ones((rows, lay.num_kv_heads, prompt), bool) for lay in model.module.layouts]


def _hidden(model, tokens, prompt: int, scheme, cut=None, prefix=None):
    """``tokens`` [1, T] through ``model`` with the prompt cut to ``cut`` (None: kept whole), served from ``scheme``'s
    pages (None: unquantized); ``prefix``: the prompt's ``prompt_prefix`` (every cut of one plan shares it)."""
    if scheme is None:
        return model.hidden(tokens) if cut is None else hidden_after(model, tokens, cut, prefix=prefix)
    return hidden_after(model, tokens, _everything(model, prompt) if cut is None else cut, kv=scheme, prefix=prefix)


def _by_method(specs: list[Eviction | None]) -> dict:
    """The policies grouped by what their scores depend on (method, window, pooling, noise): one scoring each."""
    groups: dict = {}
    for spec in specs:
        if spec is not None:
            key = (spec.method, spec.window, spec.pool, spec.tau, spec.seed)
            groups.setdefault(key, []).append(spec)
    return groups


def _score_plan(scores: dict, plan: str, model, prompt_tokens, specs):
    """Each scoring group's prompt scores for ``plan`` into ``scores`` (keyed by plan and group), all of them from
    one forward and one compile (``scores_and_prefix``), and the prompt's prefix that forward leaves (keyed by plan
    alone; every cut decodes from it), which it returns (None without policies); a plan already scored (another
    --kv-bits) is skipped."""
    groups = _by_method(specs)
    if not groups:
        return None
    if plan not in scores:
        found, scores[plan] = scores_and_prefix(model, prompt_tokens, [group[0] for group in groups.values()])
        scores.update({(plan, key): got for key, got in zip(groups, found, strict=True)})
    return scores[plan]


def _label(spec: Eviction | None) -> str:
    return "none" if spec is None else spec.name


def _window_runs(base, models, specs, chunk, prompt: int, kept: dict, source: str) -> list[tuple[tuple, jax.Array]]:
    """(key, hidden states of the scored positions) of the uncompressed model, each plan alone and each plan under
    each policy, for one window ``chunk`` [1, T]; each policy's kept byte share goes to ``kept``."""
    window = chunk.shape[1]

    def scored(hidden):
        return hidden[0, prompt - 1 : window - 1]

    runs: list[tuple[tuple, jax.Array]] = [((source, "none", "none"), scored(base.hidden(chunk)))]
    scores: dict = {}  # per plan and scoring group: a plan served at several --kv-bits is scored once
    for fields, model, scheme in models:
        prefix = _score_plan(scores, fields["plan"], model, chunk[:, :prompt], specs)  # one prompt for every cut
        by_groups = fields["cut"] == "groups"  # served whole, its pages are its "slots" twin's: not run again
        if fields["name"] != "none" and not by_groups:
            runs.append(((source, fields["name"], "none"), scored(_hidden(model, chunk, prompt, scheme, None, prefix))))
        for group_key, group in _by_method(specs).items():
            for spec in group:
                if by_groups and spec.method not in metrics.WINDOWED:
                    continue  # the engine's cut by groups scores with the last queries only
                found = scores[fields["plan"], group_key]
                cut = keep(model, found, spec)
                if by_groups:
                    cut = group_cut(model, found, cut, scheme.page_size, spec.recent)
                key = (source, fields["name"], spec.name)
                kept.setdefault(key, []).append(kept_bytes(cut, model.module.layouts, scheme))
                runs.append((key, scored(_hidden(model, chunk, prompt, scheme, cut, prefix))))
        _progress(f"{source}: {fields['name']} under every policy")
    return runs


_STARTED = time.time()


def _progress(what: str) -> None:
    """A line on stderr with the seconds since the run began: the first window compiles every model's forwards, long
    enough (tens of minutes on a busy host) to need saying where it is."""
    print(f"[{time.time() - _STARTED:.0f}s] {what}", file=sys.stderr, flush=True)


def run_eval(base, args, save=None) -> list[dict]:
    """One row per source, plan and policy: the continuation's ppl, KL and top-1, the kept share and overall rate;
    ``save(rows)`` gets the rows of every window scored so far after each window (a run cut short keeps them)."""
    window = args.windows[0]
    specs, models = policies(args), served_models(base, args, plan_models(base, args, window))
    prompt = window - args.continuation
    sums: dict = {}
    kept: dict = {}
    for source in args.sources:
        ids = accuracy.heldout_ids(base, source, args.eval_tokens)
        for start in range(0, len(ids) - window + 1, window):
            chunk = np.asarray(ids[start : start + window], np.int32)[None]
            targets = chunk[0, 1:][prompt - 1 :]
            runs = _window_runs(base, models, specs, chunk, prompt, kept, source)
            base_hidden = runs[0][1]
            for r in range(0, len(targets), accuracy.LOGIT_ROWS):
                rows = slice(r, r + accuracy.LOGIT_ROWS)
                base_logp = accuracy.log_probs(base, base_hidden[rows])
                for key, hidden in runs:
                    block = accuracy.window_sums(base_logp, accuracy.log_probs(base, hidden[rows]), targets[rows])
                    sums[key] = block if key not in sums else accuracy._add(sums[key], block)
            print(f"{source} window at {start}: {len(runs)} models scored", file=sys.stderr, flush=True)
            if save is not None:
                save(_eval_rows(sums, kept, models, window, prompt))
    rows = _eval_rows(sums, kept, models, window, prompt)
    for row in rows:
        print(accuracy._fmt(row), flush=True)
    return rows


def _named(models) -> dict:
    """Each served model's fields by name, the uncompressed model's included."""
    return {"none": {"plan": "none", "kv_bits": None, "plan_rate": 0.0, "rate": 0.0, "cut": "slots"}} | {
        f["name"]: f for f, _, _ in models
    }


def _eval_rows(sums: dict, kept: dict, models, window: int, prompt: int) -> list[dict]:
    """``run_eval``'s rows from its running sums."""
    named = _named(models)
    rows = []
    for (source, name, policy), total in sums.items():
        fields = named[name]
        share = float(np.mean(kept[(source, name, policy)])) if policy != "none" else None
        overall = fields["rate"] if share is None else 1.0 - share
        row = {"source": source, "window": window, "prompt": prompt, "plan": fields["plan"]}
        row |= {
            "kv_bits": fields["kv_bits"],
            "cut": fields["cut"],
            "evict": policy,
            "plan_rate": fields["plan_rate"],
            "overall_rate": overall,
        }
        rows.append(row | accuracy._scores([total]))
    return rows


def _stack(row: dict) -> str:
    """What a row's eviction sits on: "alone", "plan", "4-bit", "plan + 4-bit", "plan + 4-bit by groups"."""
    parts = (["plan"] if row["plan"] != "none" else []) + ([f"{row['kv_bits']}-bit"] if row.get("kv_bits") else [])
    return " + ".join(parts) + (" by groups" if row.get("cut") == "groups" else "") or "alone"


def within_one_percent(rows: list[dict]) -> list[dict]:
    """Per source and method ("none": no eviction): the largest overall rate among rows whose perplexity is within
    1% of the uncompressed model's, per stack under the method (``_stack``: alone, on a plan, on quantized pages,
    on both)."""
    out = []
    for source in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == source]
        base = next(r["ppl"] for r in mine if _stack(r) == "alone" and r["evict"] == "none")
        methods = sorted({r["evict"].split(":")[0] for r in mine if r["evict"] != "none"})
        stacks = sorted({_stack(r) for r in mine}, key=lambda s: (s != "alone", s))
        for method, stack in itertools.product(["none", *methods], stacks):
            pool = [
                r
                for r in mine
                if (r["evict"] == "none" if method == "none" else r["evict"].split(":")[0] == method)
                and _stack(r) == stack
            ]
            if not pool:
                continue  # a method no group cut runs (H2O), or a group cut's model served whole (its slots twin's)
            passing = [r for r in pool if accuracy.AT_99["ppl"](r["ppl"], base)]
            best = max(passing, key=lambda r: r["overall_rate"], default=None)
            if method == "none" and stack == "alone":
                continue  # the uncompressed model itself
            what = stack if method == "none" else method + ("" if stack == "alone" else f" + {stack}")
            out.append(
                {
                    "source": source,
                    "what": what,
                    "largest_overall_rate": None if best is None else best["overall_rate"],
                    "at": None if best is None else " ".join(_at(best)),
                    "ppl": None if best is None else best["ppl"],
                    "base_ppl": base,
                }
            )
    return out


def answer_ids(tokenizer, expected: str) -> list[int]:
    """The answer's tokens as they follow "... is": the number with its leading space."""
    return list(tokenizer(" " + expected, add_special_tokens=False)["input_ids"])


def answered(model, hidden, prompt: int, answer: list[int]) -> bool:
    """Whether the greedy choice after the ``prompt`` tokens and after each answer token is the next answer token
    (``hidden``: [1, T, E] of the prompt followed by the answer)."""
    logits = np.asarray(model.project(hidden[0, prompt - 1 : prompt - 1 + len(answer)]))
    return bool((logits.argmax(-1) == np.asarray(answer)).all())


def run_retrieval(base, args, save=None) -> list[dict]:
    """Per task, context, plan and policy: the share of trials whose answer is teacher-forced right. ``save(rows)``
    is called with the rows so far after every trial: a run cut short (a device call's time limit) keeps what it
    measured."""
    specs = policies(args)
    models = served_models(base, args, plan_models(base, args, max(args.contexts) + ANSWER_ROOM))
    hits: dict = {}
    kept: dict = {}
    for task, context, depth, trial in itertools.product(args.task, args.contexts, args.depths, range(args.trials)):
        rng = retrieval.trial_rng(args.seed, task, context, depth, trial)
        prompt = retrieval.build_prompt(task, base.tokenizer, context, depth, rng)
        answer = answer_ids(base.tokenizer, prompt.expected)
        p = len(prompt.ids)
        # one length per context (the answer padded with its last token, which nothing before it sees): every
        # trial of a context runs the same compiled forwards (a new length recompiled all of them, on a GPU minutes)
        room = max(ANSWER_ROOM, len(answer))
        tokens = np.asarray([prompt.ids + answer + answer[-1:] * (room - len(answer))], np.int32)

        scores: dict = {}  # per plan and scoring group: a plan served at several --kv-bits is scored once
        for fields, model, scheme in models:
            prefix = _score_plan(scores, fields["plan"], model, tokens[:, :p], specs)  # one prompt for every cut
            for group_key, group in [(None, [None]), *_by_method(specs).items()]:
                for spec in group:
                    key = (task, context, fields["name"], _label(spec))
                    if spec is None:
                        hidden = _hidden(model, tokens, p, scheme, None, prefix)
                    else:
                        cut = keep(model, scores[fields["plan"], group_key], spec)
                        kept.setdefault(key, []).append(kept_bytes(cut, model.module.layouts, scheme))
                        hidden = _hidden(model, tokens, p, scheme, cut, prefix)
                    hits.setdefault(key, []).append(answered(model, hidden, p, answer))
        _progress(f"{task} {context} depth {depth} trial {trial} done")
        if save is not None:
            save(_retrieval_rows(hits, kept, models))
    rows = _retrieval_rows(hits, kept, models)
    for row in rows:
        print(accuracy._fmt(row), flush=True)
    return rows


def run_served_retrieval(base, args, save=None) -> list[dict]:
    """Per task, context, plan, ``--kv-bits`` entry and policy: the share of trials whose answer the engine generates
    right (``retrieval.run`` with ``eviction`` and ``kv_bits``: quantized pages of the engine's group, ``quant.GROUP``,
    per head under eviction), the policies those the engine runs. ``save(rows)`` after each run."""
    specs, models = policies(args), plan_models(base, args, max(args.contexts) + ANSWER_ROOM)
    rows: list[dict] = []
    for (fields, model), kv in itertools.product(models, args.kv_bits):
        rate = fields["rate"] if kv is None else accuracy.overall_rate(base, model.plan, kv, GROUP)
        for spec in specs:
            results = retrieval.run(
                model,
                args.task,
                args.contexts,
                args.depths,
                args.trials,
                seed=args.seed,
                max_batch=args.max_batch,
                kv_bits=kv,
                eviction=None if spec is None else spec.name,
                progress=False,
            )
            for task, result in results.items():
                for context in result["contexts"]:
                    cells = [c for c in result["cells"] if c["context"] == context]
                    kept = 1.0 if spec is None or spec.ratio is None else 1.0 / spec.ratio
                    rows.append(
                        {"task": task, "context": context, "plan": fields["plan"], "kv_bits": kv}
                        | {"evict": _label(spec), "overall_rate": 1.0 - (1.0 - rate) * kept, "served": True}
                        | {
                            "accuracy": float(np.mean([c["accuracy"] for c in cells])),
                            "trials": len(cells) * args.trials,
                        }
                    )
                    print(accuracy._fmt(rows[-1]), flush=True)
            if save is not None:
                save(rows)
    return rows


def _retrieval_rows(hits: dict, kept: dict, models) -> list[dict]:
    named = _named(models)
    rows = []
    for (task, context, name, policy), got in hits.items():
        fields = named[name]
        share = kept.get((task, context, name, policy))
        overall = fields["rate"] if share is None else 1.0 - float(np.mean(share))
        rows.append(
            {"task": task, "context": context, "plan": fields["plan"], "kv_bits": fields["kv_bits"]}
            | {"evict": policy, "overall_rate": overall, "accuracy": float(np.mean(got)), "trials": len(got)}
        )
    return rows


def _at(row: dict) -> list[str]:
    cut = ["groups"] if row.get("cut") == "groups" else []
    return [row["plan"], *([f"kv{row['kv_bits']}"] if row.get("kv_bits") else []), *cut, row["evict"]]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=("eval", "retrieval"))
    p.add_argument("--model", default="smollm2", help="model path or 'smollm2' (default)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--methods", nargs="*", default=["kvcompress"], choices=metrics.METHODS, help="default: kvcompress")
    p.add_argument("--budgets", type=accuracy._positive, nargs="*", default=[], help="tokens kept per KV head")
    p.add_argument("--ratios", type=_ratio_arg, nargs="*", default=[], help="prompt tokens over the ratio kept")
    p.add_argument("--evict", type=_evict_arg, nargs="*", default=[], help="more policies, e.g. snapkv:4x:global")
    p.add_argument(
        "--page-size", type=accuracy._positive, default=16, help="evictions (and --kv-bits pages) in pages (default 16)"
    )
    p.add_argument(
        "--kv-bits",
        type=accuracy._kv_bits,
        nargs="+",
        default=[None],
        metavar="B",
        help="'none' (default) and/or quantized pages: 4, 2 (KIVI-style), gear4, gear2, ...",
    )
    p.add_argument(
        "--group-cuts",
        action="store_true",
        help="eval, with --kv-bits: each quantized model also cut by whole groups of --page-size positions (continual "
        "eviction's cut; kvcompress and snapkv only), beside the slot cut (compacted, then quantized: the prompt's)",
    )
    p.add_argument("--plans", type=_plan_arg, nargs="+", default=[None], help="'none' and/or VARIANT:RATE")
    p.add_argument("--calibration", default="text", help="plans' calibration source (default text)")
    p.add_argument("--num-tokens", type=accuracy._positive, default=16384)
    p.add_argument("--seq-len", type=accuracy._positive, default=512)
    p.add_argument("--sources", nargs="+", default=list(accuracy.SOURCES), choices=list(accuracy.SOURCES))
    p.add_argument("--eval-tokens", type=accuracy._positive, default=8192, help="eval: held-out tokens a source")
    p.add_argument("--windows", type=accuracy._positive, nargs=1, default=[4096], help="eval: window (default 4096)")
    p.add_argument(
        "--continuation", type=accuracy._positive, default=1024, help="eval: scored tokens after the prompt (1024)"
    )
    p.add_argument("--task", nargs="+", default=list(retrieval.TASKS), choices=retrieval.TASKS)
    p.add_argument("--contexts", type=accuracy._positive, nargs="+", default=[4096, 8192])
    p.add_argument("--depths", type=accuracy._fraction, nargs="+", default=list(retrieval.DEPTHS))
    p.add_argument("--trials", type=accuracy._positive, default=4, help="retrieval: trials per depth (default 4)")
    p.add_argument(
        "--served",
        action="store_true",
        help="retrieval: the engine generates each answer with the policy's eviction",
    )
    p.add_argument("--max-batch", type=accuracy._positive, default=8, help="--served: prompts decoded at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p


def _check_kv_bits(p, args) -> None:
    """``--kv-bits`` combinations this harness cannot score, as usage errors."""
    quantized = [kv for kv in args.kv_bits if kv is not None]
    if args.group_cuts and not quantized:
        p.error("--group-cuts cuts quantized pages by whole groups: give --kv-bits 4 (or 2, gear4, ...) with it")
    if args.group_cuts and args.mode != "eval":
        p.error("--group-cuts: eval mode only (retrieval cuts each prompt once, by slots)")
    if args.served and any(not isinstance(kv, int) for kv in quantized):
        p.error("--served --kv-bits: the evicting engine serves KIVI-style 4 or 2 bits only, not GEAR's")
    if any(str(kv).startswith("zipcache") for kv in quantized):
        p.error("--kv-bits: ZipCache ranks tokens by its own probe queries over the whole sequence; not with eviction")
    rebuilt = [v for v, _ in filter(None, args.plans) if accuracy.VARIANTS[v][0] != "zack" or v in accuracy.BANDS]
    if quantized and rebuilt:
        p.error(f"--kv-bits: quantized pages serve plain ZACK and uncompressed plans only, not {sorted(set(rebuilt))}")


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.mode == "eval" and args.continuation >= args.windows[0]:
        p.error(f"--continuation {args.continuation} leaves no prompt in a window of {args.windows[0]}")
    if args.mode == "eval" and args.eval_tokens < args.windows[0]:
        p.error(f"--eval-tokens {args.eval_tokens} is fewer than the window {args.windows[0]}")
    _check_kv_bits(p, args)
    if args.served and args.mode != "retrieval":
        p.error("--served runs retrieval through the engine: give it with the retrieval mode")
    jax.config.update("jax_default_matmul_precision", "highest")
    start = time.time()
    base = kvjax.load(args.model, dtype=args.dtype)
    plans = ["none" if e is None else f"{e[0]}:{e[1]:g}" for e in args.plans]
    saved = vars(args) | {"plans": plans, "evict": [e.name for e in args.evict]}

    def save(rows, extra=None, partial=True):
        if args.json:
            out = {"mode": args.mode, "args": saved, "rows": rows} | (extra or {})
            write_json(args.json, out | ({"partial": True} if partial else {}), indent=1)

    if args.mode == "eval":
        rows = run_eval(base, args, save)
        summary = within_one_percent(rows)
        extra = {"within_one_percent": summary}
        text = f"\n\nlargest overall rate within 1% of the uncompressed perplexity\n\n{accuracy.table(summary)}"
    else:
        run = run_served_retrieval if args.served else run_retrieval
        rows, extra, text = run(base, args, save), {}, ""
    print(f"\n{args.mode} on {args.model} ({args.dtype}), {time.time() - start:.0f} s\n\n{accuracy.table(rows)}{text}")
    save(rows, extra, partial=False)


if __name__ == "__main__":
    main()
