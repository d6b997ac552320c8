"""End-to-end serving, measured as the ZACK and FDC papers do: requests sent at Poisson arrival times to a running
``kvjax-serve`` on this machine, each timed from the client's side (time to first token, every gap between tokens,
job completion time), swept over request rates. Prompts are random token ids whose lengths, and the outputs', are
drawn to match a trace of the ZACK paper's Table 3 (outputs run to their drawn length: ``ignore_eos``); every token
comes with its id (``return_token_ids``), so a gap is a step, not a character. Writes a JSON of every request's
stamps and prints a table; bench/plot_serve.py draws the plots from the JSONs on the CPU. Table:
bench/results/serving.md "Serving: latency against request rate"."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from urllib.parse import urlparse

import numpy as np

from bench.files import write_json

# (input average, min, max), (output average, min, max) in tokens: ZACK paper, Table 3 (Cocktail: the long one)
TRACES = {
    "imdb": ((315, 106, 821), (37, 16, 87)),
    "arxiv": ((6300, 1600, 14100), (243, 29, 464)),
    "humaneval": ((204, 75, 697), (139, 11, 552)),
    "cocktail": ((16200, 9400, 28800), (159, 44, 246)),
}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def draw_lengths(rng, avg: float, lo: int, hi: int, n: int) -> np.ndarray:
    """``n`` lengths in [lo, hi] whose mean is about ``avg``: a log-normal (spread 0.6) clipped to the range, its
    scale bisected so that the clipped mean lands on the average."""
    z = rng.lognormal(0.0, 0.6, n)
    a, b = 1e-3, 10.0 * hi
    for _ in range(60):
        mid = (a + b) / 2
        a, b = (mid, b) if np.clip(mid * z, lo, hi).mean() < avg else (a, mid)
    return np.clip(np.round(b * z), lo, hi).astype(int)


def workload(
    trace: str, n: int, rate: float, vocab: int, seed: int, scale: float = 1.0, documents: int = 0, question: int = 64
):
    """``n`` requests of ``trace`` (lengths times ``scale``): (send time s, prompt ids, output tokens), arrivals
    Poisson at ``rate`` requests a second. ``documents`` > 0: a shared-prefix trace, each prompt one of that many
    documents (lengths drawn from the trace) followed by a question of its own, ``question`` tokens."""
    rng = np.random.default_rng(seed)
    (i_avg, i_lo, i_hi), (o_avg, o_lo, o_hi) = TRACES[trace]

    def scaled(avg, lo, hi):
        return max(1.0, avg * scale), max(1, int(lo * scale)), max(1, int(hi * scale))

    inputs = draw_lengths(rng, *scaled(i_avg, i_lo, i_hi), n)
    outputs = draw_lengths(rng, *scaled(o_avg, o_lo, o_hi), n)
    sends = np.cumsum(rng.exponential(1.0 / rate, n))
    if documents:
        docs = [rng.integers(0, vocab, int(i)).tolist() for i in inputs[:documents]]
        prompts = [docs[int(rng.integers(0, documents))] + rng.integers(0, vocab, question).tolist() for _ in range(n)]
        return [(float(t), p, int(o)) for t, p, o in zip(sends, prompts, outputs)]
    return [(float(t), rng.integers(0, vocab, int(i)).tolist(), int(o)) for t, i, o in zip(sends, inputs, outputs)]


async def one(client, url: str, model: str, send_at: float, prompt, max_tokens: int, start: float) -> dict:
    """Send one streamed completion at ``start + send_at``; its stamps in seconds from ``start``."""
    await asyncio.sleep(max(0.0, start + send_at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "return_token_ids": True}
    sent = time.perf_counter() - start
    record = {"sent": sent, "input": len(prompt), "asked": max_tokens, "token_times": [], "error": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    n = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                    record["token_times"] += [time.perf_counter() - start] * n  # one event's tokens share its time
    except Exception as e:  # a failed request is recorded, never silently dropped
        record["error"] = f"{type(e).__name__}: {e}"
    return record


def summary(records: list[dict], slo_ttft: float, slo_tbt: float) -> dict:
    """Percentiles of TTFT, TBT (every gap, pooled) and JCT in seconds; throughput; goodput at the SLOs (a request
    meets them when its TTFT and its mean gap are within them)."""
    done = [r for r in records if not r["error"] and r["token_times"]]
    ttft = np.array([r["token_times"][0] - r["sent"] for r in done])
    jct = np.array([r["token_times"][-1] - r["sent"] for r in done])
    gaps = np.concatenate([np.diff(r["token_times"]) for r in done]) if done else np.zeros(0)
    span = max((r["token_times"][-1] for r in done), default=0.0) - min((r["sent"] for r in records), default=0.0)
    good = [
        r
        for r, t in zip(done, ttft)
        if t <= slo_ttft and (len(r["token_times"]) < 2 or np.diff(r["token_times"]).mean() <= slo_tbt)
    ]
    tokens = sum(len(r["token_times"]) for r in done)

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else math.nan

    return dict(
        requests=len(records),
        finished=len(done),
        errors=sum(bool(r["error"]) for r in records),
        short=sum(len(r["token_times"]) != r["asked"] for r in done),
        **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 95, 99)},
        **{f"tbt_p{q}_ms": 1e3 * pct(gaps, q) for q in (50, 95, 99)},
        **{f"jct_p{q}_s": pct(jct, q) for q in (50, 95, 99)},
        normalized_latency_s_per_token=float(np.mean([j / len(r["token_times"]) for r, j in zip(done, jct)]))
        if done
        else math.nan,
        requests_per_s=len(done) / span if span > 0 else math.nan,
        output_tokens_per_s=tokens / span if span > 0 else math.nan,
        goodput_requests_per_s=len(good) / span if span > 0 else math.nan,
    )


def rate_workloads(args) -> list[tuple[float, int, list]]:
    """(rate, seed, requests) for each rate of ``args.rates``: rate i draws with seed ``args.seed + i`` (the same
    prompts at every rate would make a later rate's prompts prefix-cache hits of an earlier one's), and sends
    nothing after ``args.max_seconds`` (at least one request)."""
    out = []
    for i, rate in enumerate(args.rates):
        seed = args.seed + i
        work = workload(args.trace, args.requests, rate, args.vocab, seed, args.scale, args.documents, args.question)
        out.append((rate, seed, [w for w in work if w[0] <= args.max_seconds] or work[:1]))
    return out


async def sweep(args) -> dict:
    """Every rate of ``args.rates`` in turn, each drained before the next; the JSON (``args.json``) is rewritten
    after each rate, so a run cut short keeps the rates it finished."""
    import httpx

    # idle connections expire before uvicorn's default 5 s keep-alive closes them: a request sent on a socket the
    # server is closing fails with a ReadError and never reaches the server
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        health = (await client.get(args.url + "/health")).json()
        model = args.model or (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        runs: list[dict] = []
        out = dict(
            model=model,
            url=args.url,
            trace=args.trace,
            scale=args.scale,
            method=args.method,
            slo_ttft_s=args.slo_ttft,
            slo_tbt_ms=args.slo_tbt_ms,
            health_before=health,
            runs=runs,
        )
        for rate, seed, work in rate_workloads(args):
            start = time.perf_counter() + 0.1
            records = await asyncio.gather(*(one(client, args.url, model, t, p, o, start) for t, p, o in work))
            stats = summary(list(records), args.slo_ttft, args.slo_tbt_ms / 1e3)
            runs.append(dict(rate=rate, seed=seed, summary=stats, records=list(records)))
            print_row(rate, stats)
            out["health_after"] = (await client.get(args.url + "/health")).json()
            if args.json:
                write_json(args.json, out)
    return out


HEADER = (
    "| rate req/s | finished | TTFT p50 / p99 s | TBT p50 / p99 ms | JCT p50 / p99 s | s/token | req/s | "
    "out tok/s | goodput req/s |\n|---|---|---|---|---|---|---|---|---|"
)


def print_row(rate: float, s: dict) -> None:
    print(
        f"| {rate:g} | {s['finished']}/{s['requests']} | {s['ttft_p50_s']:.3f} / {s['ttft_p99_s']:.3f} | "
        f"{s['tbt_p50_ms']:.1f} / {s['tbt_p99_ms']:.1f} | {s['jct_p50_s']:.2f} / {s['jct_p99_s']:.2f} | "
        f"{s['normalized_latency_s_per_token']:.4f} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.0f} | "
        f"{s['goodput_requests_per_s']:.2f} |",
        flush=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="a kvjax-serve on this machine (loopback only)")
    ap.add_argument("--model", help="the served model's name (default: the one /v1/models lists)")
    ap.add_argument("--method", default="", help="a label for the JSON and the plots, e.g. 'zack 0.5'")
    ap.add_argument("--trace", choices=sorted(TRACES), default="arxiv", help="request shapes (default arxiv)")
    ap.add_argument("--rates", default="0.5,1,2,4", help="request rates per second, comma-separated")
    ap.add_argument("--requests", type=int, default=200, help="requests per rate (default 200)")
    ap.add_argument("--max-seconds", type=float, default=600, help="send no request later than this per rate")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the trace's lengths (smoke runs: 0.01)")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this (default 32000)")
    ap.add_argument(
        "--documents",
        type=int,
        default=0,
        help="a shared-prefix trace: every prompt is one of this many documents (the trace's lengths) and a question "
        "of its own (default 0: every prompt its own)",
    )
    ap.add_argument("--question", type=int, default=64, help="with --documents: a question's tokens (default 64)")
    ap.add_argument(
        "--seed", type=int, default=0, help="the first rate's workload seed; each later rate takes the next (default 0)"
    )
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="goodput's TTFT bound, seconds (default 10)")
    ap.add_argument("--slo-tbt-ms", type=float, default=100.0, help="goodput's mean-gap bound, ms (default 100)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a request may take (default 3600)")
    ap.add_argument("--json", help="write every request's stamps and the summaries here")
    args = ap.parse_args(argv)
    if urlparse(args.url).hostname not in LOOPBACK:
        ap.error(f"--url must be on this machine ({', '.join(sorted(LOOPBACK))}): the benchmark sends only loopback")
    args.rates = [float(r) for r in args.rates.split(",")]
    if min(args.rates) <= 0 or args.requests < 1:
        ap.error("rates and --requests must be positive")
    if args.documents < 0 or args.question < 1:
        ap.error("--documents must be 0 or more and --question positive")
    print(f"\n{args.trace} trace, {args.requests} requests a rate, {args.url}\n{HEADER}", flush=True)
    asyncio.run(sweep(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
