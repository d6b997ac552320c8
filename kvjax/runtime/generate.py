"""``kvjax.generate``: prompts in, new tokens and text out, through the paged engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from kvjax import validate
from kvjax.runtime.cache import block_table
from kvjax.runtime.engine import Engine, bucket


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # new token ids (the stop/EOS token that ended generation included)
    text: str | None  # decoded new tokens, cut before a stop string; None without a tokenizer
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def encode_prompt(model, prompt, chat: bool, name: str = "prompt") -> list[int]:
    """A prompt (a string, or token ids) as checked token ids; errors name it ``name``."""
    if isinstance(prompt, str):
        tok = model.tokenizer
        if tok is None:
            raise ValueError(f"{name} is a string, but this model has no tokenizer: pass lists of token ids")
        if chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
        return validate.token_ids(name, list(ids), model.config.vocab_size)
    return validate.token_ids(name, prompt, model.config.vocab_size)


def _engine(
    model, max_batch: int, seq_len: int, page_size: int, backend: str | None, batch_invariant: bool = False
) -> Engine:
    """Engines are cached on the model so their compiled steps are reused across calls."""
    key = (max_batch, seq_len, page_size, backend, batch_invariant)
    if key not in model._engines:
        model._engines.clear()  # keep one cache's memory alive at a time
        model._engines[key] = Engine(
            model,
            max_batch=max_batch,
            max_seq_len=seq_len,
            page_size=page_size,
            backend=backend,
            batch_invariant=batch_invariant,
        )
    return model._engines[key]


def generate(
    model,
    prompts: Sequence,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str | int] | str | None = None,
    *,
    chat: bool = False,
    max_batch: int = 8,
    max_seq_len: int | None = None,
    page_size: int = 16,
    backend: str | None = None,
    batch_invariant: bool = False,
    stats: dict | None = None,
) -> list[Generation]:
    """Generate up to ``max_new_tokens`` tokens for each prompt (strings, or lists of token ids).

    ``temperature=0`` is greedy decoding. ``stop`` holds stop strings and/or stop token ids (EOS always stops).
    ``chat=True`` wraps string prompts in the tokenizer's chat template. ``max_seq_len`` (default: the model's
    ``max_position_embeddings``) bounds prompt + new tokens per sequence. ``backend`` picks the attention path:
    "pallas" (the kernels, default on a GPU), "reference" (jnp, default elsewhere) or "interpret" (the kernels on the
    CPU). ``stats``, if given, receives timings.

    ``batch_invariant=True``: a prompt's tokens depend only on it, ``seed`` and the fixed settings (``max_batch``,
    ``max_seq_len``, ``page_size``, backend, dtype, device), never on the other prompts or their order: prompts are
    prefilled one at a time, every decode step runs ``max_batch`` rows, the cache is sized for ``max_seq_len``, the
    kernels split each sequence by its own length (``schedule.fixed_chunk_schedule``) and samples draw from
    ``seed`` and the step alone (so equal prompts sample equally). Its cost: bench/RESULTS.md, "Batch invariance".
    """
    max_new_tokens = validate.positive("max_new_tokens", max_new_tokens)
    temperature, top_p, seed = validate.temperature(temperature), validate.top_p(top_p), validate.seed(seed)
    max_batch, page_size = validate.positive("max_batch", max_batch), validate.positive("page_size", page_size)
    chat, batch_invariant = validate.flag("chat", chat), validate.flag("batch_invariant", batch_invariant)
    capacity = model.config.max_position_embeddings
    if max_seq_len is not None:
        capacity = validate.positive("max_seq_len", max_seq_len)
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
    stop_ids |= set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        stop_ids.add(model.tokenizer.eos_token_id)
    if stop_texts and model.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; pass stop token ids instead")

    seq_len = capacity  # batch-invariant: a cache shape no prompt of the call chooses
    if not batch_invariant:
        seq_len = min(bucket(max(map(len, encoded), default=0) + max_new_tokens, minimum=page_size), capacity)
    engine = _engine(model, max_batch, seq_len, page_size, backend, batch_invariant)
    stats = {} if stats is None else stats
    stats.update(prefill_s=0.0, decode_s=0.0, prompt_tokens=sum(map(len, encoded)), new_tokens=0)
    key = jax.random.key(seed)
    results = []
    for start in range(0, len(encoded), max_batch):
        if not batch_invariant:
            key, sub = jax.random.split(key)
        results += _run_batch(
            model,
            engine,
            encoded[start : start + max_batch],
            max_new_tokens,
            temperature,
            top_p,
            key if batch_invariant else sub,
            stop_ids,
            stop_texts,
            stats,
        )
    return results


def _prefill(engine, batch, pages, key, temperature, top_p):
    """First tokens [rows] and the block table [rows, pages] of a batch; batch-invariant: one prompt at a time, and
    ``max_batch`` rows."""
    if not engine.batch_invariant:
        return engine.prefill(batch, pages, key, temperature, top_p)
    first = [np.asarray(engine.prefill([ids], [p], key, temperature, top_p)[0])[0] for ids, p in zip(batch, pages)]
    rows = engine.max_batch
    token = jax.numpy.asarray(np.array(first + [0] * (rows - len(batch)), np.int32))
    return token, block_table(pages + [[]] * (rows - len(batch)), engine.pages_per_seq)


def _run_batch(model, engine, batch, max_new_tokens, temperature, top_p, key, stop_ids, stop_texts, stats):
    """Generate for one batch; ``done`` rows keep decoding (their tokens are dropped) until every row is done."""

    def step_key(j):  # batch-invariant: the seed's own stream at step j; else split off the batch's key
        nonlocal key
        if engine.batch_invariant:
            return jax.random.fold_in(key, j)
        key, sub = jax.random.split(key)
        return sub

    pages = []
    try:
        for ids in batch:
            pages.append(engine.allocator.allocate(-(-(len(ids) + max_new_tokens) // engine.page_size)))
        t0 = time.perf_counter()
        token, table = _prefill(engine, batch, pages, step_key(0), temperature, top_p)
        out = [[int(t)] for t in np.asarray(token)[: len(batch)]]
        t1 = time.perf_counter()
        positions = np.zeros(table.shape[0], np.int32)
        positions[: len(batch)] = [len(ids) for ids in batch]
        done = [_finished(model, o, stop_ids, stop_texts) for o in out]
        for step in range(1, max_new_tokens):
            if all(done):
                break
            token = engine.decode(token, positions, table, step_key(step), temperature, top_p)
            positions = positions + (np.arange(len(positions)) < len(batch))  # new array: the step may alias it
            for row, t in enumerate(np.asarray(token)[: len(batch)]):
                if not done[row]:
                    out[row].append(int(t))
                    done[row] = _finished(model, out[row], stop_ids, stop_texts)
        stats["prefill_s"] += t1 - t0
        stats["decode_s"] += time.perf_counter() - t1
    finally:
        for p in pages:
            engine.allocator.free(p)
    stats["new_tokens"] += sum(map(len, out))
    return [_result(model, ids, o, done[row], stop_texts) for row, (ids, o) in enumerate(zip(batch, out))]


def _finished(model, tokens, stop_ids, stop_texts) -> bool:
    """The last token is a stop id, or a stop string ends in the text of the last tokens.

    Every token decodes to at least one byte, so a stop string of n UTF-8 bytes lies within the last n + 1
    tokens (one more for a token that starts before it)."""
    if tokens[-1] in stop_ids:
        return True
    if stop_texts:
        window = max(len(s.encode("utf-8")) for s in stop_texts) + 2
        text = model.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        return any(s in text for s in stop_texts)
    return False


def _result(model, prompt, tokens, stopped, stop_texts) -> Generation:
    text = None
    if model.tokenizer is not None:
        text = model.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.index(s) for s in stop_texts if s in text]
        text = text[: min(cuts)] if cuts else text
    return Generation(tokens, text, len(prompt), "stop" if stopped else "length")
