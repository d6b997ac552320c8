"""``kvjax-infer``: batch inference over a JSONL file of prompts, written atomically."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from tqdm.auto import tqdm


def _read_prompts(path: str) -> list:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt = record["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: expected a JSON object with a \"prompt\" key ({e})")
            is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
            if not isinstance(prompt, str) and not is_ids:
                raise SystemExit(f"{path}:{n}: \"prompt\" must be a string or a list of token ids")
            prompts.append(prompt)
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def write_atomically(path: str, lines: list[str]) -> None:
    """Write to a temporary file beside ``path`` and rename it into place, so no half-written file remains."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kvjax-infer-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="kvjax-infer", description="Run greedy or sampled generation for every prompt of a JSONL file.",
        epilog="Each input line is {\"prompt\": \"text\" or [token ids]}; each output line adds \"text\", "
               "\"tokens\" and \"finish_reason\". The output is written only once every prompt has finished.")
    p.add_argument("--model", required=True,
                   help="Hugging Face directory, .gguf file, kvjax checkpoint (Model.save, convert/convert.py), "
                        "or 'smollm2' (embedded)")
    p.add_argument("--prompts", required=True, help="input JSONL file")
    p.add_argument("--out", required=True, help="output JSONL file (replaced atomically)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per jitted batch (default 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap string prompts in the model's chat template")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--attention", choices=("pallas", "reference"), default=None,
                   help="attention path: the Pallas kernels (default on a GPU) or the jnp reference (default on CPU)")
    p.add_argument("--show", action="store_true", help="also print every prompt with its generated text")
    p.add_argument("--max-seq-len", type=int, default=None, help="cache positions per sequence (default: model's)")
    args = p.parse_args(argv)

    if args.max_new_tokens <= 0:
        p.error("--max-new-tokens must be positive")
    if args.batch_size <= 0:
        p.error("--batch-size must be positive")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        p.error(f"cannot write --out {args.out!r}: {out_dir} is not a writable directory")
    if not os.path.isfile(args.prompts):
        p.error(f"--prompts {args.prompts!r} does not exist")
    prompts = _read_prompts(args.prompts)

    import kvjax

    try:
        model = kvjax.load(args.model, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    records, totals = [], {"prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": 0, "new_tokens": 0}
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", unit="prompt") as bar:
        for i in range(0, len(prompts), args.batch_size):
            chunk, stats = prompts[i:i + args.batch_size], {}
            try:
                results = kvjax.generate(model, chunk, args.max_new_tokens, args.temperature, args.top_p,
                                         args.seed + i, chat=args.chat, max_batch=args.batch_size,
                                         max_seq_len=args.max_seq_len, backend=args.attention, stats=stats)
            except ValueError as e:
                p.error(f"prompts {i}..{i + len(chunk) - 1}: {e}")
            for key in totals:
                totals[key] += stats[key]
            for prompt, r in zip(chunk, results):
                records.append(json.dumps({"prompt": prompt, "text": r.text, "tokens": r.tokens,
                                           "finish_reason": r.finish_reason}) + "\n")
            bar.update(len(chunk))
    write_atomically(args.out, records)
    if args.show:
        for line in records:
            r = json.loads(line)
            print(f"> {r['prompt']}\n{r['text'] if r['text'] is not None else r['tokens']}\n")
    wall = time.perf_counter() - start
    print(f"wrote {len(records)} results to {args.out} in {wall:.1f} s: "
          f"{totals['prompt_tokens']} prompt tokens at {totals['prompt_tokens'] / max(totals['prefill_s'], 1e-9):.0f} "
          f"tok/s (prefill), {totals['new_tokens']} generated tokens at "
          f"{totals['new_tokens'] / max(totals['decode_s'], 1e-9):.1f} tok/s (decode), compilation included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
