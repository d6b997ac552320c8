"""How a target rate's kept columns are best split between Q/K and V (issue 17 item 3): per plan (one removal rate
for both, the uniform plan's split by singular-value mass, and fixed Q/K shares), the held-in KL from the
uncompressed model on calibration text (what ``compress(k_share="measured")`` minimises) beside held-out
perplexity. Results: bench/results/accuracy.md "Compression: K and V budgets".

    python -m bench.kv_split --model smollm2 --method zack --rate 0.5 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import kvjax
from bench.accuracy import perplexity
from bench.files import write_json
from kvjax.compression import calibrate, calibration_tokens, fold
from kvjax.compression.pipeline import BASIS
from kvjax.compression.plan import RankPlan
from kvjax.compression.split import kl_to
from kvjax.compression.text import pydoc_text


def plans(method: str, rate: float, k_basis, v_basis, shares, uniform_shares) -> list[tuple[str, RankPlan]]:
    """(name, plan) of every variant compared: adaptive (one removal rate, then each share), then uniform."""
    out = [("adaptive, one removal rate", RankPlan.for_target_rate(method, k_basis.s, v_basis.s, rate))]
    for f in shares:
        out.append(
            (f"adaptive, Q/K share {f:g}", RankPlan.for_target_rate(method, k_basis.s, v_basis.s, rate, k_share=f))
        )
    out.append(
        ("uniform, split by singular values", RankPlan.for_target_rate(method, k_basis.s, v_basis.s, rate, False))
    )
    for f in uniform_shares:
        plan = RankPlan.for_target_rate(method, k_basis.s, v_basis.s, rate, False, k_share=f)
        out.append((f"uniform, Q/K share {f:g}", plan))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", choices=sorted(BASIS), default="zack")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--shares", type=float, nargs="*", default=[0.3, 0.4, 0.5, 0.6, 0.7])
    ap.add_argument("--uniform-shares", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    ap.add_argument("--num-tokens", type=int, default=8192, help="calibration text tokens (default 8192)")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens, in windows of 1,024")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not 0 < args.rate < 1 or any(not 0 < f < 1 for f in args.shares + args.uniform_shares):
        ap.error("--rate and every share must lie strictly between 0 and 1")
    if args.num_tokens < 512 or args.eval_tokens < 1024:
        ap.error("--num-tokens must be at least one 512-token row and --eval-tokens one 1,024-token window")
    base = kvjax.load(args.model, dtype="float32", progress=False)
    t0 = time.perf_counter()
    tokens = calibration_tokens(base, "prose", args.num_tokens, 512, seed=0)
    stats = calibrate(base, tokens, progress=False)
    print(f"calibrated on {args.num_tokens} text tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    k_kind, v_kind = BASIS[args.method]
    k_basis, v_basis = stats.basis(k_kind, base), stats.basis(v_kind, base)
    held = np.asarray(base.tokenizer(pydoc_text("heldout"), add_special_tokens=False)["input_ids"][: args.eval_tokens])
    score = kl_to(base, tokens, 4)  # as compress(k_share="measured") does
    base_ppl = perplexity(base, held, window=1024)
    print(f"\n{args.model}, {args.method}, target rate {args.rate}; uncompressed held-out perplexity {base_ppl:.2f}")
    print("| plan | rate | Q/K share | held-in KL | held-out ppl |\n|---|---|---|---|---|")
    rows = []
    for name, plan in plans(args.method, args.rate, k_basis, v_basis, args.shares, args.uniform_shares):
        model = fold(base, plan, {"k": k_basis, "v": v_basis})
        share = float(plan.k_qk.sum() / (plan.k_qk.sum() + plan.k_v.sum()))
        row = dict(plan=name, rate=plan.rate, k_share=share, kl_heldin=score(model), ppl=perplexity(model, held, 1024))
        rows.append(row)
        print(f"| {name} | {row['rate']:.4f} | {share:.3f} | {row['kl_heldin']:.4f} | {row['ppl']:.2f} |", flush=True)
    if args.json:
        write_json(args.json, dict(args=vars(args), base_ppl=base_ppl, rows=rows), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
