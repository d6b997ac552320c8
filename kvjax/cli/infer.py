"""``kvjax-infer``: inference over a JSONL file of prompts, continuously batched, each result written in input order as
soon as it and those before it finish."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

from tqdm.auto import tqdm

from kvjax import validate
from kvjax.cli import options

EPILOG = """\
input (--prompts): JSONL, one JSON object per line with a "prompt" key: a
  string (tokenized by the model's tokenizer; --chat wraps it in the chat
  template) or a list of integer token ids. Blank lines are skipped.

output (--out): JSONL, one record per prompt, in input order ("index" is the
  prompt's 0-based position among the prompts):
    {"index": 0, "prompt": ..., "text": "..." (null without a tokenizer),
     "tokens": [...], "finish_reason": "stop" or "length"}
  A prompt that cannot be generated (a token id outside the vocabulary, too
  long for the cache with --max-new-tokens, or generation failed before it
  finished) gets
    {"index": n, "prompt": ..., "error": "..."}
  and the other prompts go on.

  Records go to OUT.partial (beside OUT), each line flushed as soon as it and
  every record before it have finished; OUT.partial is renamed onto OUT once every prompt has a
  record, so an existing OUT is replaced whole or not at all. An interrupted
  run (Ctrl-C, a crash) keeps its finished records in OUT.partial and leaves
  OUT as it was.

  Flags, paths and the input file are checked before the model is loaded;
  prompts are checked against the model before anything is generated.

exit status:
  0    every prompt has a result
  1    some prompts got an error record (summary on stderr), or OUT.partial
       could not be written
  2    usage error: a bad flag, path, model or input line (nothing written)
  130  interrupted (Ctrl-C); finished records are kept in OUT.partial
"""


def _message(e: BaseException) -> str:
    """One line describing ``e``: its message's first line, behind its type unless that is ValueError/TypeError."""
    lines = str(e).strip().splitlines()
    text = lines[0][:500] if lines else ""
    if type(e) in (ValueError, TypeError) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _json_type(value) -> str:
    """The JSON name of a parsed value's type, with the value when it is short."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    name = names.get(type(value), "number")
    shown = json.dumps(value)
    return f"{name} {shown}" if len(shown) <= 40 else name


def _prompt(record):
    """The "prompt" of one parsed input line: a string, or a non-empty list of integer token ids >= 0."""
    if not isinstance(record, dict):
        raise ValueError(f'expected a JSON object with a "prompt" key, got {_json_type(record)}')
    if "prompt" not in record:
        keys = ", ".join(json.dumps(k) for k in list(record)[:5]) + (", ..." if len(record) > 5 else "")
        raise ValueError(f'no "prompt" key (keys: {keys or "none"})')
    prompt = record["prompt"]
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f'"prompt" is not valid text: lone surrogate {prompt[e.start]!r} at character {e.start}'
            ) from None
        return prompt
    if isinstance(prompt, list):
        return validate.token_ids('"prompt"', prompt, math.inf)  # the vocabulary is checked once the model is loaded
    raise ValueError(f'"prompt" must be a string or a list of token ids, got {_json_type(prompt)}')


def _read_prompts(path: str) -> list:
    """The prompts of a JSONL file; raises ValueError as ``path:line: what is wrong`` for the first bad line."""
    with open(path, "rb") as f:
        data = f.read()
    prompts, problems = [], []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as e:
            problems.append(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line)")
            continue
        if not line.strip():
            continue
        try:
            prompts.append(_prompt(json.loads(line)))
        except json.JSONDecodeError as e:
            problems.append(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})")
        except RecursionError:
            problems.append(f"{path}:{n}: JSON nested too deeply")
        except (TypeError, ValueError) as e:
            problems.append(f"{path}:{n}: {e}")
    if problems:
        more = len(problems) - 1
        raise ValueError(problems[0] + (f" (and {more} more bad line{'s' * (more > 1)})" if more else ""))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (through links too); ``a`` need not exist."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def _check_paths(p: argparse.ArgumentParser, args) -> None:
    """Refuse (as usage errors) a --prompts that is no readable file and an --out that cannot be written safely."""
    if not os.path.exists(args.prompts):
        p.error(f"--prompts {args.prompts!r}: no such file")
    if not os.path.isfile(args.prompts):
        p.error(f"--prompts {args.prompts!r} is not a regular file")
    out, partial = args.out, args.out + ".partial"
    if os.path.isdir(out):
        p.error(f"--out {out!r} is a directory")
    if os.path.lexists(out) and not os.path.isfile(out):
        p.error(f"--out {out!r} exists and is not a regular file")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        p.error(f"--out {out!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"--out {out!r}: directory {parent!r} is not writable")
    if _same_file(out, args.prompts) or _same_file(partial, args.prompts):
        p.error(f"--out {out!r} would overwrite --prompts {args.prompts!r}")
    if os.path.lexists(partial) and not os.path.isfile(partial):
        p.error(f"--out {out!r}: {partial!r} exists and is not a regular file")


def _encode(model, prompts: list, args, capacity: int, where: str) -> tuple[dict, dict]:
    """Each prompt's token ids, or the one-line reason it cannot be generated: ({index: ids}, {index: error})."""
    from kvjax.runtime.text import encode_prompt

    encoded, errors = {}, {}
    for n, prompt in enumerate(prompts):
        try:
            ids = encode_prompt(model, prompt, args.chat, f"prompt {n}")
        except Exception as e:
            errors[n] = _message(e)
            continue
        if len(ids) + args.max_new_tokens > capacity:
            errors[n] = (
                f"prompt {n} has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} it needs "
                f"{len(ids) + args.max_new_tokens} cache positions, more than the {capacity} of {where}"
            )
        else:
            encoded[n] = ids
    return encoded, errors


def _run(args, prompts: list, encoded: dict, errors: dict, run, stats: dict) -> int:
    """Write the records of ``run`` (the encoded prompts, continuously batched) into OUT.partial, then rename it
    onto OUT; returns the status."""
    partial = args.out + ".partial"
    records: list[dict] = [
        {"index": n, "prompt": prompts[n], "error": errors[n]} if n in errors else {} for n in range(len(prompts))
    ]
    good = sorted(encoded)
    written = 0
    if os.path.exists(partial):
        print(f"kvjax-infer: replacing {partial}, left by an earlier run", file=sys.stderr)
    start = time.perf_counter()
    try:
        f = open(partial, "w", encoding="utf-8")
    except OSError as e:
        print(f"kvjax-infer: error: cannot write {partial}: {e.strerror or e}", file=sys.stderr)
        return 1

    def flush() -> None:
        """Write the records finished so far that follow the written ones in input order, each line whole."""
        nonlocal written
        while written < len(records) and records[written]:
            f.write(json.dumps(records[written]) + "\n")
            written += 1
        f.flush()

    # Closed on the way out, so an interrupted run waits for the steps it left on the device before the process
    # exits (``Runner.run``/``Runner.settle``): exiting with one still computing aborts the process (SIGABRT, 134).
    results = contextlib.closing(_generate(run, prompts, good))
    try:
        with f, tqdm(total=len(good), desc="generating", unit="prompt") as bar, results as each:
            flush()
            for n, record in each:
                records[n] = record
                flush()
                bar.update(1)
            os.fsync(f.fileno())
    except BaseException as e:
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped by {_message(e)}"
        print(
            f"kvjax-infer: {what}: the {written} finished records (of {len(prompts)}) are kept in {partial}; "
            f"{args.out} was left as it was",
            file=sys.stderr,
        )
        if isinstance(e, KeyboardInterrupt):
            return 130
        if isinstance(e, OSError):
            return 1
        raise
    os.replace(partial, args.out)
    return _report(args, records, stats, time.perf_counter() - start)


def _start(args, model, ids: list, stats: dict):
    """Queue the prompts on an engine built for them (``kvjax.generate_iter``); a setting the engine refuses, such as
    a --cache-memory that holds no pages, raises ValueError here, before anything is written."""
    import kvjax

    run = kvjax.generate_iter(
        model,
        ids,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        max_seq_len=args.max_seq_len,
        batch_invariant=args.batch_invariant,
        compile_cache=args.compile_cache,
        stats=stats,
        **options.engine_settings(args),  # kv_bits "model" unless given: the checkpoint's choice (kvjax.generate)
    )
    print(f"kvjax-infer: {run.runner.engine.describe()}", file=sys.stderr, flush=True)  # what the machine got
    return run


def _generate(run, prompts: list, index: list):
    """(prompt index, record) as each prompt finishes; if generation fails, an error record for each prompt left."""
    pending = set(index)
    try:
        for i, r in run:
            n = index[i]
            pending.discard(n)
            yield (
                n,
                {
                    "index": n,
                    "prompt": prompts[n],
                    "text": r.text,
                    "tokens": r.tokens,
                    "finish_reason": r.finish_reason,
                },
            )
    except Exception as e:
        message = f"generation failed: {_message(e)}"
        for n in sorted(pending):
            yield n, {"index": n, "prompt": prompts[n], "error": message}


def _report(args, records: list[dict], stats: dict, wall: float) -> int:
    """Print the records (--show) and the throughput; 1 if any prompt failed, else 0."""
    if args.show:
        for r in records:
            body = f"error: {r['error']}" if "error" in r else r["text"] if r["text"] is not None else r["tokens"]
            print(f"> {r['prompt']}\n{body}\n")
    if stats:
        first = sorted(stats["first_token_s"])
        print(
            f"wrote {len(records)} records to {args.out} in {wall:.1f} s: {stats['prompt_tokens']} prompt tokens and "
            f"{stats['new_tokens']} generated tokens in {stats['steps']} steps, "
            f"{stats['new_tokens'] / max(stats['wall_s'], 1e-9):.1f} generated tok/s, median time to first token "
            f"{first[len(first) // 2] if first else 0.0:.2f} s, compilation included"
        )
    else:
        print(f"wrote {len(records)} records to {args.out} in {wall:.1f} s")
    failed = sum("error" in r for r in records)
    if failed:
        print(
            f'kvjax-infer: {failed} of {len(records)} prompts failed; their records in {args.out} hold an "error"',
            file=sys.stderr,
        )
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command's argument parser; every ``type=`` refuses a bad value as a usage error."""
    p = argparse.ArgumentParser(
        prog="kvjax-infer",
        description="Run greedy or sampled generation for every prompt of a JSONL file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_model(p)
    p.add_argument("--prompts", required=True, help="input JSONL file (format below)")
    p.add_argument("--out", required=True, help="output JSONL file (format below; written through OUT.partial)")
    p.add_argument(
        "--max-new-tokens",
        type=options.positive("max_new_tokens"),
        default=64,
        help="new tokens per prompt (default 64)",
    )
    options.add_engine(p)
    p.add_argument(  # the old name of --max-batch, kept working (without a help line) for scripts that use it
        "--batch-size", dest="max_batch", type=options.positive("max_batch"), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--temperature", type=validate.arg(validate.temperature, float), default=0.0, help="0 is greedy (default)"
    )
    p.add_argument(
        "--top-p",
        type=validate.arg(validate.top_p, float),
        default=1.0,
        help="nucleus sampling mass in (0, 1] (default 1.0)",
    )
    p.add_argument("--seed", type=validate.arg(validate.seed, int), default=0, help="random seed >= 0 (default 0)")
    p.add_argument("--chat", action="store_true", help="wrap string prompts in the model's chat template")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each prompt's tokens depend on it alone, not on the prompts running beside it (chunks run one at "
        "a time and every decode step runs --max-batch rows; see kvjax.generate)",
    )
    p.add_argument("--show", action="store_true", help="also print every prompt with its generated text")
    p.add_argument(
        "--max-seq-len",
        type=options.positive("max_seq_len"),
        default=None,
        help="cache positions per sequence: prompt + new tokens (default: the model's)",
    )
    return p


def main(argv=None) -> int:
    """Run ``kvjax-infer``; returns 0 (all prompts done), 1 (some failed) or 130 (interrupted); usage errors exit 2."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        _check_paths(p, args)
        try:
            prompts = _read_prompts(args.prompts)
        except (OSError, ValueError) as e:
            p.error(str(e))

        import kvjax

        try:
            model = kvjax.load(args.model, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
        except (OSError, ValueError) as e:
            p.error(f"--model {args.model!r}: {e}")
        capacity = args.max_seq_len or model.config.max_position_embeddings
        where = "--max-seq-len" if args.max_seq_len else "the model's max_position_embeddings"
        if args.max_new_tokens >= capacity:
            p.error(
                f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the {capacity} cache "
                f"positions of {where}"
            )
        encoded, errors = _encode(model, prompts, args, capacity, where)
        stats: dict = {}
        try:
            run = _start(args, model, [encoded[n] for n in sorted(encoded)], stats)
        except ValueError as e:
            p.error(str(e))
    except KeyboardInterrupt:
        print("kvjax-infer: interrupted before generating; nothing was written", file=sys.stderr)
        return 130
    return _run(args, prompts, encoded, errors, run, stats)


if __name__ == "__main__":
    sys.exit(main())
