"""``kvjax-serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from kvjax import validate
from kvjax.cli import options

EPILOG = """\
endpoints:
  POST /v1/completions        {"model", "prompt": text or token ids, "max_tokens", "temperature",
                               "top_p", "stop", "seed", "stream"}
  POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], ...} through the model's
                               chat template ("max_completion_tokens" or "max_tokens"; default: what
                               the cache leaves)
  GET  /v1/models             the one model served (--served-model-name)
  GET  /health                status, running and waiting requests, free and total KV pages (and
                              per sliding window, its own pool's: "window_pages")

  "stream": true answers with server-sent events, ending with "data: [DONE]". A bad request (malformed
  JSON, another model, a prompt too long for the cache, max_tokens <= 0, temperature outside [0, 2],
  top_p outside (0, 1]) gets a 400 with OpenAI's error body; the others are not disturbed. A client that
  disconnects cancels its request and its KV pages are freed at once.

example:
  kvjax-serve --model smollm2 --port 8000 &
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-');
  print(c.completions.create(model='smollm2', prompt='The capital of France is', max_tokens=8).choices[0].text)"

signals:
  SIGTERM or Ctrl-C: stop accepting connections, let requests in flight finish for --grace seconds, then
  abort the rest (finish_reason "abort") and exit 0.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvjax-serve",
        description="Serve a model over an OpenAI-compatible HTTP API, continuously batched on the KV-compressed "
        "engine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_model(p)
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model's base name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument(
        "--port",
        type=validate.arg(lambda v: validate.integer("port", v, low=1, high=65535), int),
        default=8000,
        help="TCP port (default 8000)",
    )
    p.add_argument(
        "--max-seq-len",
        type=options.positive("max_seq_len"),
        default=None,
        help="cache positions per sequence: prompt + new tokens (default: the model's, at most 8192 on a GPU and "
        "2048 on a CPU, and at most what the cache holds); one the cache cannot hold once is refused",
    )
    options.add_engine(p)
    p.add_argument(
        "--compile-ahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile every step shape the engine can run before listening, with progress bars, so no request "
        "waits for a compile (a compressed 8B model's steps take seconds each: see --prefill-min-tokens). With the "
        "compile cache on, steps it does not hold yet are traced in parallel processes, and a later start reads "
        "them back traced and compiled (default: on a GPU, not on a CPU, where steps compile in seconds)",
    )
    p.add_argument(
        "--prefill-min-tokens",
        type=options.positive("prefill_min_tokens"),
        default=None,
        help="shortest padded length of a prefill call (default: a page); larger means fewer step shapes",
    )
    p.add_argument(
        "--prefill-max-rows",
        type=options.positive("prefill_max_rows"),
        default=None,
        help="most prompt chunks one prefill call holds (default: --max-batch); fewer means fewer step shapes",
    )
    p.add_argument(
        "--keep-alive",
        type=validate.arg(lambda v: validate.integer("keep_alive", v, low=1), int),
        default=None,
        help="seconds an idle connection stays open (default 75: longer than HTTP clients pool one, 5 s for httpx "
        "and openai, so a client never sends on a connection the server is closing)",
    )
    p.add_argument(
        "--grace",
        type=validate.arg(lambda v: validate.number("grace", v, low=0.0), float),
        default=30.0,
        help="seconds requests in flight may take to finish after SIGTERM (default 30)",
    )
    return p


def build_engine(args, model):
    """The engine the flags ask for, its defaults fitted to this machine (``EngineConfig.for_machine``): 32
    sequences of up to 8192 positions on a GPU, 4 of up to 2048 on a CPU (where a step's cost follows both), the
    cache at most a share of the memory free. A --max-seq-len the cache cannot hold once is refused; the default
    one shrinks to what it holds, and the start-up lines say so (``Engine.describe``)."""
    from kvjax.runtime.config import EngineConfig, kv_bits_for
    from kvjax.runtime.engine import Engine
    from kvjax.runtime.memory import CacheTooSmall

    settings = options.engine_settings(args)
    settings["kv_bits"] = kv_bits_for(model, args.kv_bits)  # by default the checkpoint's choice (--kv-bits none: none)
    config = EngineConfig.for_machine(
        model.config.max_position_embeddings,
        max_seq_len=args.max_seq_len,
        prefill_min_tokens=args.prefill_min_tokens,
        prefill_max_rows=args.prefill_max_rows,
        **settings,
    )
    try:
        return Engine(model, config)
    except CacheTooSmall as e:
        if args.max_seq_len is not None:
            message = str(e).replace("max_seq_len", "--max-seq-len").replace("cache_memory", "--cache-memory")
            raise ValueError(message) from None
        if e.tokens < 16:
            raise
        good = e.tokens
    # The longest sequence the budget holds: a shorter one needs less room for a step's activations, which leaves
    # the cache more tokens, so step up to what each try holds (a few tries; each ends in one that fits)
    engine = Engine(model, config.replace(max_seq_len=good))
    for _ in range(4):
        more = min(config.max_seq_len, engine.cache_tokens)
        if more < good + engine.page_size:
            break
        del engine  # one cache alive at a time
        try:
            engine, good = Engine(model, config.replace(max_seq_len=more)), more
        except CacheTooSmall:
            engine = Engine(model, config.replace(max_seq_len=good))
            break
    print(
        f"kvjax-serve: a sequence of the default {config.max_seq_len} positions does not fit the cache "
        f"({engine.budget_note}); serving {engine.max_seq_len} positions a sequence instead (--max-seq-len, "
        "--cache-memory)",
        file=sys.stderr,
    )
    return engine


def positions_warning(engine, model) -> str | None:
    """What the server says, once at start, when it serves sequences past the positions the model's ZACK basis was
    made for (``RankPlan.max_context``; ``kvjax.compress``'s default covers the model's context): None when it does
    not."""
    limit = None if model.plan is None else model.plan.max_context
    if limit is None or engine.max_seq_len <= limit:
        return None
    return (
        f"sequences of up to {engine.max_seq_len} positions are served, but the model's compression plan was made "
        f"for positions 0..{limit - 1} (max_context={limit}); quality past them may degrade (re-convert with "
        "kvjax-convert --max-context model, the default, or --max-seq-len to stay within)"
    )


def capacity_line(engine, model) -> str:
    """The KV capacity in tokens, its overall rate counting every byte a token takes (codes, scales and zeros of
    quantized pages too: ``Engine.token_bytes``) against the uncompressed model in the cache's dtype, and what the
    same pages' bytes would hold uncompressed."""
    from kvjax.layout import HeadLayout
    from kvjax.ops.kv_schemes import label
    from kvjax.runtime.cache import bytes_per_token

    tokens = engine.cache_tokens
    cfg = model.config
    full = (HeadLayout.uniform(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),) * cfg.num_layers
    ratio = sum(engine.token_bytes().values()) / bytes_per_token(full, engine.cache_dtype)
    compressed = model.plan is not None or engine.formats is not None
    what = [] if model.plan is None else [f"{model.plan.method} rate {model.plan.rate:.2f}"]
    what += [] if engine.formats is None else [f"{label(engine.kv_bits)} pages"]
    rate = f"at overall rate {1 - ratio:.2f} ({' + '.join(what)})" if compressed else "uncompressed"
    extra = f", {int(tokens * ratio):,} uncompressed in the same memory" if compressed else ""
    windows = "".join(
        f"; layers with a {w}-token window: {n - 1} pages, given back as the window passes"
        for w, n in engine.window_pages.items()
    )
    pages = f"{engine.num_pages - 1} pages of {engine.page_size}{windows}"
    if engine.eviction is not None:  # the tokens are those of the per-head pool; each prompt then keeps fewer
        pages = (
            f"{engine.head_pages - 1} per-head pages and {engine.num_pages - 1} staging pages of {engine.page_size}; "
            f"each prompt evicted to {engine.eviction.name} once prefilled"
        )
    sharing = "; identical prefixes share pages (/health: prefix_hit_tokens)" if engine.prefix_caching else ""
    return f"KV cache: {tokens:,} tokens {rate}{extra} ({pages}; {engine.budget_note}{sharing})"


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        import uvicorn  # noqa: F401 (used by kvjax.serving.api)
    except ImportError:
        p.error("kvjax-serve needs FastAPI and uvicorn: pip install 'kvjax[serve]'")
    import kvjax
    from kvjax.runtime import compile_cache
    from kvjax.serving.api import FLUSH_S, KEEP_ALIVE_S, create_app, graceful_server, server_config
    from kvjax.serving.worker import Worker

    try:
        cached = compile_cache.use(args.compile_cache)
    except ValueError as e:
        p.error(f"--compile-cache: {e}")
    try:
        model = kvjax.load(args.model, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
    except (OSError, ValueError) as e:
        p.error(f"--model {args.model!r}: {e}")
    try:
        engine = build_engine(args, model)
    except ValueError as e:
        p.error(str(e))
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    import jax

    if args.compile_ahead or (args.compile_ahead is None and jax.default_backend() == "gpu"):
        cores = os.cpu_count() or 1
        engine.compile_ahead(threads=cores, progress=True, processes=cores)
    worker = Worker(engine).start()
    app = create_app(worker, model, name)
    print(f"kvjax-serve: {engine.describe()}", file=sys.stderr, flush=True)
    print(capacity_line(engine, model), file=sys.stderr, flush=True)
    where = "off" if cached is None else str(cached)
    print(f"kvjax-serve: compile cache {where} (--compile-cache)", file=sys.stderr, flush=True)
    if (past := positions_warning(engine, model)) is not None:
        print(f"kvjax-serve: warning: {past}", file=sys.stderr, flush=True)
    print(f"kvjax-serve: {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    config = server_config(
        app,
        args.host,
        args.port,
        keep_alive=args.keep_alive or KEEP_ALIVE_S,
        timeout_graceful_shutdown=FLUSH_S,  # once --grace is over and the rest aborted: their responses' flush
    )
    # On SIGTERM or Ctrl-C, uvicorn leaves its loop and calls the server's shutdown (graceful_server), still on the
    # running event loop: stop accepting, give the requests in flight --grace seconds, abort the rest through the
    # worker (each stream ends with its "abort" chunk and [DONE]), stop and join the engine thread, let the
    # responses flush; only then does the loop close. A second Ctrl-C cuts the grace short.
    server = graceful_server(config, app.state.server, args.grace)
    # uvicorn then raises the signal again for the handler it found: a no-op one here, so a requested stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:  # (stopped already, unless uvicorn failed before its shutdown)
        app.state.server.accepting = False
        worker.stop(grace_s=0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
