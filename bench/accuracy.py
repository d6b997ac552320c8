"""Accuracy harness: perplexity on held-out text.

Today: SmolLM2's perplexity on Python's ``pydoc_data.topics`` next to the number ``transformers`` gives for the same
token ids (both stored in tests/fixtures/smollm2_reference.npz by tests/make_fixtures.py, which defines the slice:
1024 ids as 4 independent windows of 256 tokens).

    python bench/accuracy.py [--model smollm2] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvjax  # noqa: E402

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "smollm2_reference.npz")


def perplexity(model, tokens: np.ndarray, window: int = 256, batch: int = 4) -> float:
    """exp(mean NLL) of predicting tokens 1..window-1 of every independent ``window``-token slice of ``tokens``."""
    n = len(tokens) // window
    windows = np.asarray(tokens[:n * window], np.int32).reshape(n, window)
    nll = []
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        logp = jax.nn.log_softmax(model.logits(chunk)[:, :-1], axis=-1)
        nll.append(-np.take_along_axis(np.asarray(logp, np.float64), chunk[:, 1:, None], axis=-1)[..., 0])
    return float(np.exp(np.concatenate(nll).mean()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model path or 'smollm2' (default)")
    p.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    ref = np.load(REFERENCE)
    model = kvjax.load(args.model, dtype=args.dtype)
    ppl = perplexity(model, ref["ppl_tokens"])
    rows = [("kvjax", args.dtype, ppl), ("transformers (GGUF, float32)", "float32", float(ref["ppl"]))]
    print(f"perplexity of {args.model} on {len(ref['ppl_tokens'])} tokens of pydoc_data.topics "
          f"(4 windows of 256)\n")
    print(f"| {'implementation':<30} | {'dtype':<8} | {'perplexity':>10} |\n|{'-' * 32}|{'-' * 10}|{'-' * 12}|")
    for name, dtype, value in rows:
        print(f"| {name:<30} | {dtype:<8} | {value:>10.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(zip(("implementation", "dtype", "perplexity"), r)) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
