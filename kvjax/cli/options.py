"""The flags ``kvjax-infer`` and ``kvjax-serve`` share, defined once so that they read and check the same way."""

from __future__ import annotations

import argparse

from kvjax import machine, validate
from kvjax.ops.kv_schemes import SERVED, ScoredOnly, served


def kv_bits_arg(*, model: bool):
    """An argparse ``type`` for --kv-bits: 4 or 2, a GEAR name (``kv_schemes.served``: gear2, gear2-r1-o0.01, ...)
    or 'none' (None: pages of the cache's dtype); with ``model`` also 'model' (kept as the string: the model's own
    choice, ``kvjax.generate``'s default), the value argparse converts for the default of kvjax-infer and
    kvjax-serve."""

    def kv_bits(text: str):
        word = text.strip().lower()
        if word == "none":
            return None
        if model and word == "model":
            return "model"
        try:
            return served(word)
        except ScoredOnly as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("kv_bits: ")) from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {SERVED} or 'none', got {text!r}") from None

    return kv_bits


def eviction_arg(text: str):
    """An argparse ``type`` for --evict: 'none', or a policy the engine can run ("kvcompress:4x", "h2o:256":
    ``runtime.config.engine_eviction``); a bad one is a usage error in its own words."""
    from kvjax.runtime.config import engine_eviction

    if text.strip().lower() == "none":
        return None
    try:
        return engine_eviction(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive(name: str):
    """An argparse ``type`` for an integer >= 1 (a bad value is a usage error naming ``name``)."""
    return validate.arg(lambda v: validate.positive(name, v), int)


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face directory, .gguf file, kvjax checkpoint (Model.save, kvjax-convert), "
        "or 'smollm2' / 'gemma3-270m' (embedded)",
    )


def add_engine(p: argparse.ArgumentParser) -> None:
    """The engine's flags, one per ``EngineConfig`` field a user sets, named and defaulted alike in kvjax-infer and
    kvjax-serve: --max-batch, --page-size, --chunk-tokens, --cache-memory, --dtype, --kv-bits, --evict,
    --tensor-parallel, --attention, --no-prefix-caching and --compile-cache."""
    p.add_argument(
        "--max-batch",
        type=positive("max_batch"),
        default=None,
        metavar="N",
        help=f"most sequences decoded at once; a finished one's place goes to the next at once (default "
        f"{machine.GPU_MAX_BATCH} on a GPU, {machine.CPU_MAX_BATCH} on a CPU, where a step's cost follows it)",
    )
    p.add_argument(
        "--page-size",
        type=positive("page_size"),
        default=None,
        metavar="TOKENS",
        help="tokens a page of the KV cache: smaller pages waste less of a sequence's last page, larger ones mean "
        "fewer block-table entries; the GPU kernels take a power of two of at least 16 (default 16, or 32 with "
        "--kv-bits, the keys' quantization group)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt whole, sharing no pages (by default the full pages of identical prefixes are "
        "shared, read-only, where the cache allows it: not with --evict, --kv-bits or sliding-window models)",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="keep steps traced (in DIR/steps) and compiled (JAX's persistent compilation cache) in this "
        "directory, so the next start on this machine skips both; 'off' leaves it off (default: "
        "$KVJAX_COMPILE_CACHE, else ~/.cache/kvjax/jax)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=positive("chunk_tokens"),
        default=512,
        help="prompt tokens prefilled per step, a budget the prompts being prefilled share, beside the running "
        "sequences' decoding, which always runs: more prefills faster but lengthens the steps that carry it (on an "
        "H200, 2048 against 4096: the same throughput, p99 time between tokens 105 against 181 ms; "
        'bench/results/serving.md "Serving: shared prefixes and the prefill budget") (default 512)',
    )
    p.add_argument(
        "--cache-memory",
        type=validate.arg(lambda v: validate.memory_budget("cache_memory", v), validate.parse_memory),
        default=None,
        help="KV cache budget: a fraction of free device memory (e.g. 0.9) or a size (e.g. 12GiB); a compressed "
        "model's narrower pages fit more tokens in it (default: room for --max-batch full sequences, or where that "
        "is less 90%% of the free GPU memory, half of the memory this process may still use on a CPU; "
        "KVJAX_MEMORY=SIZE caps what kvjax takes to be free)",
    )
    add_dtype(p, "parameter dtype", auto=True)
    p.add_argument(
        "--kv-bits",
        type=kv_bits_arg(model=True),
        default="model",
        metavar="{4,2,gear2,...,none}",
        help="keep the KV cache in 4- or 2-bit quantized pages (KIVI-style: keys per channel over a page of 32 "
        "tokens, values per token, the newest partial page exact), about 3.5x or 6x more tokens in the same memory, "
        "on top of any rank compression; or in GEAR pages: gear4, gear2, with -r<rank> -o<outlier share> "
        "-p<page tokens> (gear2-r1-o0.01-p128: 2-bit codes, a rank-1 residual and 1%% exact outliers a head and "
        "page of 128 tokens, about 5x; decoded by the jnp reference, slower, for now); 'none': pages in the "
        "model's dtype (default: the checkpoint's choice, saved by kvjax-convert --kv-bits; pages in the model's "
        "dtype where it made none)",
    )
    p.add_argument(
        "--evict",
        type=eviction_arg,
        default=None,
        metavar="METHOD:AMOUNT",
        help="once a prompt is prefilled, keep only its most attended tokens in each KV head (scored in the space the "
        "model attends in): kvcompress (its last 8 queries, one budget shared by every head, KV-Compress), snapkv "
        "(its last 8 queries, the same budget each head), or from every query of the prompt: h2o, kvcompress-full, "
        "keyformer; AMOUNT a ratio such as 4x (a quarter of the prompt) or tokens per head such as 256; the most "
        "recent 16 tokens are always kept. When the cache fills mid-decode, a running request's heads are halved "
        "(by its last 8 queries or, for h2o, kvcompress-full and keyformer, by each token's attention summed over "
        "everything decoded; never below that budget) before any request is preempted. On sliding-window layers "
        "(Gemma 3, Mistral) a head keeps only tokens of its window, gives its pages back as the window passes and is "
        "never halved. Stacks with rank compression and with --kv-bits 4 or 2 (each head's survivors quantized in "
        "groups of --page-size slots, halved by whole groups with kvcompress and snapkv; the other methods preempt "
        "there); not with GEAR, Palu or banded models (default none)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=positive("tensor_parallel"),
        default=1,
        metavar="N",
        help="split the model over N devices of this host (JAX's sharding: each device holds its share of the "
        "weights and its KV heads' columns of every page, heads placed so each device holds about the same bytes); "
        "KV heads a multiple of N, or fewer and each replicated on N / heads devices (their query heads split "
        "among them); uncompressed and ZACK models, not GEAR pages (default 1)",
    )
    p.add_argument(
        "--attention",
        choices=("pallas", "reference"),
        default=None,
        help="attention path: the Pallas kernels (default on a GPU) or the jnp reference (default on CPU)",
    )


def engine_settings(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_engine``'s flags set, by the config's names, so both commands hand the
    engine the same settings; ``kv_bits`` as given ("model" unless set: ``config.kv_bits_for`` resolves it).
    --dtype and --compile-cache are not engine fields: each command applies them itself."""
    return dict(
        max_batch=args.max_batch,
        page_size=args.page_size,
        chunk_tokens=args.chunk_tokens,
        cache_memory=args.cache_memory,
        backend=args.attention,
        kv_bits=args.kv_bits,
        eviction=args.evict,
        tensor_parallel=args.tensor_parallel,
        prefix_caching=False if args.no_prefix_caching else None,
    )


def add_dtype(p: argparse.ArgumentParser, what: str, *, auto: bool = False) -> None:
    """--dtype; ``auto``: "auto" is allowed and the default (``kvjax.machine.default_dtype``)."""
    if not auto:
        p.add_argument(
            "--dtype",
            type=validate.arg(validate.dtype),
            default="bfloat16",
            help=f"{what}: {', '.join(validate.DTYPES)} (default bfloat16)",
        )
        return
    p.add_argument(
        "--dtype",
        type=validate.arg(lambda v: v if v == "auto" else validate.dtype(v)),
        default="auto",
        help=f"{what}: auto, {', '.join(validate.DTYPES)} (default auto: bfloat16 on a GPU; float32 on a CPU, where "
        "a small model's bfloat16 answers are not its own, unless its float32 weights would take over a quarter "
        "of the memory available)",
    )


def max_context(text: str):
    """``kvjax-convert --max-context``: "model" (the model's context length: ``compression.pipeline.MODEL_CONTEXT``),
    "calibration" (None: the positions calibration saw) or a positive number of positions."""
    from kvjax.compression.pipeline import MODEL_CONTEXT

    if text in (MODEL_CONTEXT, "calibration"):
        return MODEL_CONTEXT if text == MODEL_CONTEXT else None
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"takes 'model', 'calibration' or a number of positions, got {text!r}") from None
    return validate.positive("the count", count)
