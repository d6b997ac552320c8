"""Where the device idles inside an engine decode step: the step (random Llama-3.1-8B shape, bf16, the batch in
steady state as ``engine.py`` builds it) enqueued back to back under JAX's profiler, each gap between two kernels
of a compute stream charged to the kernel after it, summed per kernel name (numeric suffixes dropped), with the
launches per step beside. Copy and memset events are left out: the step's input copy runs on a stream of its own,
and its "gap" is the whole step. JAX's profiler and the Mosaic CUPTI timer that ``engine.py`` uses cannot share a
process (the timer aborts: "activity records were dropped"), hence a script of its own.
Table: bench/results/engine.md "Engine: where the decode step's gaps sit"."""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile

import jax
from jax.profiler import ProfileData

from bench.engine import back_to_back, model_at, prefilled, step_inputs
from bench.files import write_json
from bench.harness import count_arg, log, on_gpu, rates_arg, shape_arg
from kvjax.runtime import engine as engine_module
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request

COPIES = ("Memcpy", "Memset")  # CUPTI's names of copies and memsets: no kernel of the step ("memcpy32_post" is one)


def stream_gaps(events: list[tuple[int, int, str]]) -> dict[str, tuple[float, int]]:
    """Per kernel name: the idle ns before its launches on one stream and how many launches, from (start ns,
    duration ns, name) events; copies and memsets are skipped, and so is the gap they would close."""
    kernels = sorted(e for e in events if not e[2].startswith(COPIES))
    out: dict[str, tuple[float, int]] = {}
    for (start, length, _), (after, _, name) in zip(kernels, kernels[1:]):
        key = re.sub(r"[._]\d+$", "", name)[:60]
        gap, count = out.get(key, (0.0, 0))
        out[key] = (gap + max(0, after - start - length), count + 1)
    return out


def profile(runner: Runner, requests: list[Request], steps: int) -> dict:
    """The gaps of ``steps`` decode steps enqueued back to back, per step: busy and idle ms over the compute streams
    and, per kernel name (costliest gap first), the idle ms before it and its launches."""
    engine, inputs = runner.engine, step_inputs(runner, requests)
    engine.decode(*inputs).block_until_ready()
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                engine.decode(*inputs)
            engine.slot_tokens.block_until_ready()
        (path,) = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        data = ProfileData.from_file(path)
    names: dict[str, list[float]] = {}
    busy = 0.0
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            events = [(e.start_ns, e.duration_ns, e.name) for e in line.events]
            busy += sum(length for _, length, name in events if not name.startswith(COPIES))
            for name, (gap, count) in stream_gaps(events).items():
                total = names.setdefault(name, [0.0, 0])
                total[0] += gap / 1e6 / steps
                total[1] += count / steps
    ranked = sorted(names.items(), key=lambda kv: -kv[1][0])
    return dict(
        busy_ms=busy / 1e6 / steps,
        gap_ms=sum(g for g, _ in names.values()),
        launches=sum(c for _, c in names.values()),
        gaps_before=[dict(kernel=k, gap_ms=g, launches=c) for k, (g, c) in ranked],
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rates",
        type=rates_arg(),
        default=[0.5, 0.0],
        help="compression rates, comma-separated (default 0.5,0)",
    )
    ap.add_argument(
        "--shape", type=shape_arg("--shape"), default=(32, 2048), help="BxCTX of the decode batch (default 32x2048)"
    )
    ap.add_argument(
        "--steps", type=count_arg("--steps"), default=4, help="steps profiled (default 4: more drops CUPTI records)"
    )
    ap.add_argument(
        "--chunk-tokens", type=count_arg("--chunk-tokens"), default=2048, help="prefill chunk (default 2048)"
    )
    ap.add_argument("--top", type=count_arg("--top"), default=12, help="kernel names printed per rate (default 12)")
    ap.add_argument(
        "--no-graphs",
        action="store_true",
        help="profile the step without XLA's CUDA graphs (by default it is compiled to keep them while profiled)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.json and not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK):
        ap.error(f"--json {args.json}: its folder is not a writable directory")  # found now, not after a model's run
    if not on_gpu():
        raise SystemExit("bench/gaps.py profiles the engine on a GPU")
    if not args.no_graphs:
        engine_module.COMPILER_OPTIONS["xla_enable_command_buffers_during_profiling"] = True
    batch, ctx = args.shape
    rows = []
    for rate in args.rates:
        log(f"rate {rate}, {batch} x {ctx}")
        new = batch * -(-ctx // args.chunk_tokens) + 64
        state = prefilled(model_at(rate), batch, ctx, new, args.chunk_tokens)
        span = back_to_back(state.runner, state.requests, 16)
        row = dict(rate=rate, batch=batch, ctx=ctx, graphs=not args.no_graphs, steps=args.steps, span_ms=span * 1e3)
        row |= profile(state.runner, state.requests, args.steps)
        rows.append(row)
        print(
            f"\nrate {rate}, {batch} x {ctx}: span {row['span_ms']:.3f} ms a step, {row['busy_ms']:.3f} ms busy, "
            f"{row['gap_ms']:.3f} ms idle over {row['launches']:.0f} launches; idle ms before each kernel:"
        )
        for g in row["gaps_before"][: args.top]:
            print(f"  {g['gap_ms']:8.3f}  {g['launches']:5.0f}  {g['kernel']}")
        if args.json:  # after every rate: a run cut short keeps what it measured
            write_json(args.json, dict(device=jax.devices()[0].device_kind, rows=rows), indent=1)
        del state


if __name__ == "__main__":
    main()
