"""``kvjax.generate``: prompts in, new tokens and text out, through the continuous-batching runner."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from kvjax import validate
from kvjax.eviction.select import Eviction
from kvjax.runtime.compile_cache import use as use_compile_cache
from kvjax.runtime.config import EngineConfig, KvBits, kv_bits_for
from kvjax.runtime.engine import Engine, bucket
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request
from kvjax.runtime.text import cut_at_stop, encode_prompt, eos_ids, stopped

log = logging.getLogger("kvjax")


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # new token ids (the stop/EOS token that ended generation included)
    text: str | None  # decoded new tokens, cut before a stop string; None without a tokenizer
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def _engine(model, config: EngineConfig) -> Engine:
    """Engines are cached on the model, by their configuration, so their compiled steps are reused across calls."""
    if config not in model._engines:
        model._engines.clear()  # keep one cache's memory alive at a time
        model._engines[config] = Engine(model, config)
        log.info("kvjax.generate: engine %s", model._engines[config].describe())
    return model._engines[config]


def generate(model, prompts: Sequence, *args, progress: bool = False, **kwargs) -> list[Generation]:
    """``generate_iter``'s results in prompt order; ``progress`` shows a bar of finished prompts."""
    results: list[Generation | None] = [None] * len(prompts) if isinstance(prompts, Sequence) else []
    run = generate_iter(model, prompts, *args, **kwargs)
    with tqdm(total=len(results), desc="generating", unit="prompt", disable=not progress) as bar:
        for n, result in run:
            results[n] = result
            bar.update(1)
    return [r for r in results if r is not None]


def generate_iter(
    model,
    prompts: Sequence,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str | int] | str | None = None,
    *,
    chat: bool = False,
    max_batch: int | None = None,
    max_seq_len: int | None = None,
    page_size: int | None = None,
    chunk_tokens: int = 512,
    cache_memory: float | int | None = None,
    backend: str | None = None,
    batch_invariant: bool = False,
    kv_bits: KvBits = "model",
    eviction: Eviction | str | None = None,
    tensor_parallel: int | None = None,
    compile_cache: str | os.PathLike | None = None,
    prefix_caching: bool | None = None,
    stats: dict | None = None,
) -> _Run:
    """Check the arguments and queue the prompts; iterating the result runs them and yields (prompt index,
    ``Generation``) as each finishes.

    ``temperature=0`` is greedy decoding. ``stop`` holds stop strings and/or stop token ids (EOS always stops).
    ``chat=True`` wraps string prompts in the tokenizer's chat template. ``max_seq_len`` (default: the model's
    ``max_position_embeddings``) bounds prompt + new tokens per sequence. Prompts run continuously batched: up to
    ``max_batch`` at once (default ``machine.default_max_batch``: 32 on a GPU, 4 on a CPU, as the commands), a
    finished one's place taken by the next at once, prompts prefilled ``chunk_tokens`` per step beside the others'
    decoding. ``cache_memory`` sizes the KV cache: a fraction of the device memory free now, or bytes (default: room
    for ``max_batch`` full sequences, or 90% of free memory where that is less); prompts that do not fit at once
    wait, or are preempted and recomputed later. ``backend`` picks the attention path: "pallas" (the kernels,
    default on a GPU), "reference" (jnp, default elsewhere) or "interpret" (the kernels on the CPU). ``kv_bits`` (4
    or 2) keeps the cache in quantized pages (``EngineConfig.kv_bits``; ``page_size`` then defaults to 32, the keys'
    group); None keeps it in the cache's dtype; "model" (the default) takes the model's own choice,
    ``model.kv_bits`` (saved with a checkpoint by ``kvjax-convert --kv-bits``; None for a model that made none).
    ``eviction`` ("kvcompress:4x", "snapkv:256", an ``Eviction``; None keeps every token) evicts each prompt's
    least-attended tokens per KV head once it is prefilled (``EngineConfig.eviction``). ``tensor_parallel`` splits
    the model over that many devices (``EngineConfig.tensor_parallel``; the same tokens; default:
    ``model.tensor_parallel``, what ``kvjax.load`` was asked for, else 1). ``compile_cache``: where compiled steps
    are kept for the next process (``runtime.compile_cache.use``: a directory, None for the default
    ``~/.cache/kvjax/jax`` or ``$KVJAX_COMPILE_CACHE``, "off"). ``prefix_caching``: prompts share the cached pages
    of identical prefixes (``EngineConfig.prefix_caching``; None: wherever the cache can, False: never).
    ``stats``, if given, receives counts and per-prompt times once the iteration ends.

    Sampling draws token i of prompt n from (``seed``, n, i) alone, so it does not depend on the other prompts'
    timing. ``batch_invariant=True``: a prompt's tokens depend only on it, ``seed`` and the fixed settings
    (``max_batch``, ``max_seq_len``, ``page_size``, ``chunk_tokens``, backend, dtype, device), never on the other
    prompts or their order: chunks are cut every ``chunk_tokens`` positions and run one per call, every decode
    step runs ``max_batch`` rows, the kernels split each sequence by its own length (``schedule.fixed_chunk_schedule``)
    and every prompt samples from (``seed``, 0, i), so equal prompts sample equally. Its cost: bench/results/engine.md,
    "Batch invariance".
    """
    max_new_tokens = validate.positive("max_new_tokens", max_new_tokens)
    temperature, top_p, seed = validate.temperature(temperature), validate.top_p(top_p), validate.seed(seed)
    chat = validate.flag("chat", chat)
    config = EngineConfig(  # checks every engine setting, before any prompt is encoded
        max_batch=max_batch,  # type: ignore[arg-type]  # None: the machine's (EngineConfig)
        max_seq_len=model.config.max_position_embeddings if max_seq_len is None else max_seq_len,
        page_size=page_size,  # type: ignore[arg-type]  # None: the format's default (EngineConfig)
        chunk_tokens=chunk_tokens,
        cache_memory=cache_memory,
        backend=backend,
        batch_invariant=batch_invariant,
        kv_bits=kv_bits_for(model, kv_bits),
        eviction=eviction,
        tensor_parallel=getattr(model, "tensor_parallel", 1) if tensor_parallel is None else tensor_parallel,
        prefix_caching=prefix_caching,
    )
    use_compile_cache(compile_cache)
    capacity = config.max_seq_len
    if (
        isinstance(prompts, (str, bytes))
        or not isinstance(prompts, Sequence)
        or (len(prompts) and isinstance(prompts[0], (int, np.integer)))
    ):
        raise TypeError("prompts must be a list of prompts (strings or lists of token ids)")
    stop_ids, stop_texts = validate.stops(stop)
    encoded = [encode_prompt(model, p, chat, f"prompt {i}") for i, p in enumerate(prompts)]
    for i, ids in enumerate(encoded):
        if len(ids) + max_new_tokens > capacity:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} cache positions, more than the cache's {capacity}"
            )
    _warn_past_max_context(model, encoded, max_new_tokens)
    stop_ids |= eos_ids(model)
    if stop_texts and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; pass stop token ids instead")

    seq_len = capacity  # batch-invariant: a cache shape no prompt of the call chooses
    if not config.batch_invariant:
        seq_len = min(bucket(max(map(len, encoded), default=0) + max_new_tokens, minimum=config.page_size), capacity)
    engine = _engine(model, config.replace(max_seq_len=seq_len))
    runner = Runner(engine)
    stopper = functools.partial(stopped, model, stop_ids=stop_ids, stop_texts=stop_texts)
    requests = [
        runner.add(Request(ids, max_new_tokens, temperature, top_p, seed, 0 if config.batch_invariant else n, stopper))
        for n, ids in enumerate(encoded)
    ]
    return _Run(model, runner, requests, stop_texts, stats)


def _warn_past_max_context(model, encoded: list[list[int]], max_new_tokens: int) -> None:
    """Warn (once per call, naming the longest request) when a request runs past the positions the model's Q/K
    basis was derived for: it still runs, but its quality past them is not what the plan was made for."""
    limit = None if model.plan is None else model.plan.max_context
    if limit is None or not encoded:
        return
    i = max(range(len(encoded)), key=lambda n: len(encoded[n]))
    need = len(encoded[i]) + max_new_tokens
    if need > limit:
        over = sum(len(ids) + max_new_tokens > limit for ids in encoded)
        warnings.warn(
            f"prompt {i} needs {need} positions ({len(encoded[i])} prompt tokens + max_new_tokens={max_new_tokens}), "
            f"more than the max_context={limit} this model's compression plan was made for ({over} of "
            f"{len(encoded)} prompts go past it); its quality beyond the first {limit} positions may degrade",
            stacklevel=3,
        )


class _Run:
    """A started ``generate_iter`` call: iterate for (prompt index, Generation) as each prompt finishes."""

    def __init__(self, model, runner: Runner, requests: list[Request], stop_texts, stats: dict | None):
        self.model, self.runner, self.requests, self.stop_texts, self.stats = model, runner, requests, stop_texts, stats
        self.index = {id(r): n for n, r in enumerate(requests)}

    def __iter__(self) -> Iterator[tuple[int, Generation]]:
        start = time.perf_counter()
        for r in self.runner.run():
            yield self.index[id(r)], _result(self.model, r, self.stop_texts)
        if self.stats is not None:
            _stats(self.stats, self.requests, start, self.runner)


def _stats(stats: dict, requests: list[Request], start: float, runner: Runner) -> None:
    """Counts and per-request times (seconds from the call's start) of a finished run."""
    stats.update(
        wall_s=time.perf_counter() - start,
        steps=runner.steps,
        prompt_tokens=sum(len(r.prompt) for r in requests),
        new_tokens=sum(len(r.tokens) for r in requests),
        preemptions=sum(r.preemptions for r in requests),
        first_token_s=[r.first_token_time - start for r in requests if r.first_token_time is not None],
        finish_s=[r.finish_time - start for r in requests if r.finish_time is not None],
    )


def _result(model, r: Request, stop_texts) -> Generation:
    text = None
    if model.tokenizer is not None:
        text = cut_at_stop(model.tokenizer.decode(r.tokens, skip_special_tokens=True), stop_texts)
    return Generation(r.tokens, text, len(r.prompt), r.finish_reason or "length")


generate.__signature__ = inspect.signature(generate_iter).replace(  # type: ignore[attr-defined]
    parameters=[
        *inspect.signature(generate_iter).parameters.values(),
        inspect.Parameter("progress", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool),
    ],
    return_annotation=list[Generation],
)
