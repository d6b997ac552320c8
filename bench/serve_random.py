"""A ``kvjax-serve`` of random weights in a real model's shape, for bench/serve.py (speed needs no trained
weights): uncompressed, or compressed by ZACK or Palu to the widths of ``harness.rank_plan`` at a rate. Every method
gets the same KV memory (``--cache-memory`` bytes), so a compressed cache holds more sequences in it."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine import model_at
from harness import LLAMA_8B

from kvjax.cli.serve import capacity_line
from kvjax.runtime.engine import Engine
from kvjax.serving.api import create_app
from kvjax.serving.worker import Worker
from kvjax.validate import parse_memory

SHAPES = {
    "llama-3.1-8b": LLAMA_8B,
    "mistral-7b": dataclasses.replace(
        LLAMA_8B, arch="mistral", vocab_size=32000, rope_theta=1e6, max_position_embeddings=32768
    ),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--method", choices=("none", "zack", "palu"), default="zack")
    ap.add_argument("--rate", type=float, default=0.5, help="compression rate (ignored for --method none)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=32768)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--cache-memory", default="40GiB", help="KV cache bytes, the same for every method (40GiB)")
    args = ap.parse_args(argv)
    import uvicorn

    rate = 0.0 if args.method == "none" else args.rate
    model = model_at(rate, SHAPES[args.shape], method=args.method if rate else "zack")
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_seq_len=args.max_seq_len,
        chunk_tokens=args.chunk_tokens,
        cache_memory=parse_memory(args.cache_memory),
    )
    worker = Worker(engine).start()
    name = f"{args.shape}-{args.method}" + (f"-{rate:g}" if rate else "")
    print(capacity_line(engine, model), file=sys.stderr, flush=True)
    print(f"serving {name!r} on http://127.0.0.1:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(worker, model, name), host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
