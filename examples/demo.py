"""`make demo`'s second half: the embedded SmolLM2 answers one prompt with its full KV cache and with the cache
compressed by ZACK at rate 0.5, then says what the compression saves (KV bytes per token, tokens per GiB) and costs
(per-token KL and top-1 agreement on held-out prose, the metrics of ``bench/accuracy.py eval``).

The compressed checkpoint is built once (calibrated on prose and code shipped with Python, disjoint from the held-out
prose scored here) and kept in ``examples/.cache/`` (git-ignored); later runs load it."""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

import kvjax
from kvjax.compression.text import pydoc_text
from kvjax.io.saved import is_kvjax_checkpoint
from kvjax.runtime.cache import bytes_per_token

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "Explain in two sentences what a KV cache is in a language model."
GIB = 1 << 30


def compressed(base, path: str, rate: float, max_context: int, num_tokens: int):
    """``base`` compressed to ``rate``: read from ``path`` if an earlier run saved it there, else built (from
    ``num_tokens`` calibration tokens) and saved."""
    if is_kvjax_checkpoint(path):
        return kvjax.load(path, progress=False)
    print(f"compressing the model once (ZACK, rate {rate}, calibrated on prose and code) into {path} ...", flush=True)
    t0 = time.perf_counter()
    model = kvjax.compress(base, target_rate=rate, calibration="text", num_tokens=num_tokens, max_context=max_context)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    model.save(path)
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return model


def agreement(base, model, tokens: np.ndarray) -> tuple[float, float]:
    """(mean per-token KL(base || model) in nats, top-1 agreement) of next-token distributions over ``tokens``."""
    p, q = (jax.nn.log_softmax(m.logits(tokens[None])[0].astype(np.float32), axis=-1) for m in (base, model))
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    return kl, float((np.asarray(p).argmax(-1) == np.asarray(q).argmax(-1)).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.5, help="ZACK's overall compression rate (default 0.5)")
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache"), help="where the compressed checkpoint is kept")
    ap.add_argument("--window", type=int, default=1024, help="held-out tokens scored for the accuracy line")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--calibration-tokens", type=int, default=16384, help="calibration text tokens (default 16384)")
    args = ap.parse_args(argv)
    if not 0 < args.rate < 1:
        ap.error(f"--rate must lie in (0, 1), got {args.rate}")
    for flag in ("window", "max_new_tokens", "calibration_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    base = kvjax.load("smollm2", progress=False)
    path = os.path.join(args.cache, f"smollm2-zack-{round(args.rate * 100)}-text-{args.calibration_tokens}")
    small = compressed(base, path, args.rate, max(2048, args.window), args.calibration_tokens)

    for name, model in (("uncompressed", base), (f"ZACK, rate {small.plan.rate:.2f}", small)):
        (out,) = kvjax.generate(model, [PROMPT], max_new_tokens=args.max_new_tokens, chat=True)
        print(f"\n[{name}] {PROMPT}\n  {out.text.strip()}", flush=True)

    full, short = (bytes_per_token(m.layouts, m.dtype) for m in (base, small))
    ids = base.tokenizer(pydoc_text("heldout"), add_special_tokens=False)["input_ids"][: args.window]
    kl, top1 = agreement(base, small, np.asarray(ids, np.int32))
    print(
        f"\nKV cache: {full:,} bytes a token uncompressed, {short:,} compressed ({full / short:.2f}x the tokens in "
        f"the same memory: {GIB // full:,} against {GIB // short:,} a GiB)"
        f"\naccuracy on {len(ids):,} held-out tokens of prose: KL {kl:.3f} nats a token from the uncompressed "
        f"model, top-1 agreement {top1:.1%} (full tables: bench/RESULTS.md, python -m bench.accuracy eval)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
