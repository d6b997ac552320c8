"""``kvjax.compress`` of a random Llama-3.1-8B-shaped model (bf16) phase by phase: calibration tokens, the Gram
matrices on the device (its first batch, which compiles, apart from the rest), the bases and the rank plan (host
eigendecompositions and the F_p bisection), and folding the bases into the weights. Table: bench/results/startup.md
"Start-up: compression"."""

from __future__ import annotations

import argparse
import json
import time

import jax

from bench.engine import model_at
from bench.harness import log, on_gpu
from kvjax.compression.calibration import calibrate, calibration_tokens
from kvjax.compression.folding import fold
from kvjax.compression.pipeline import make_plan


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    ap.add_argument("--seq-len", type=int, default=512, help="calibration sequence length (default 512)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per calibration batch (default 4)")
    ap.add_argument("--rate", type=float, default=0.5, help="target rate (default 0.5)")
    ap.add_argument("--json", help="write the row here")
    args = ap.parse_args(argv)
    if not on_gpu():
        raise SystemExit("bench/startup.py times compression on a GPU")
    model = model_at(0)
    times = {}

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        jax.block_until_ready(jax.tree.leaves(getattr(out, "state", out)))
        times[name] = time.perf_counter() - t0
        log(f"{name}: {times[name]:.1f} s")
        return out

    tokens = timed("tokens", calibration_tokens, model, "random", args.tokens, args.seq_len)
    b = args.batch_size
    timed("grams: first batch (compiles)", calibrate, model, tokens[:b], batch_size=b, progress=False)
    stats = timed(f"grams: {args.tokens} tokens", calibrate, model, tokens, batch_size=b, progress=False)
    plan, bases = timed("bases and plan", make_plan, model, stats, target_rate=args.rate)
    timed("fold", fold, model, plan, bases)
    total = sum(v for k, v in times.items() if "first batch" not in k)
    print("\n| phase | seconds |\n|---|---|")
    for name, s in times.items():
        print(f"| {name} | {s:.1f} |")
    print(f"| compress (all but the separate first batch) | {total:.1f} |")
    print(f"\ncalibration throughput: {args.tokens / times[f'grams: {args.tokens} tokens']:.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, args=vars(args), seconds=times), f, indent=1)


if __name__ == "__main__":
    main()
