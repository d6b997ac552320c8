"""The kernel benchmarks' one command line: correctness of the Pallas kernels against the jnp references, then their
timings beside their floors, as named sections (``python -m bench.kernels --only SECTIONS``; ``--help`` lists each
section and the module it lives in). The ceilings the floors divide by are measured in the same run, before any
section that times kernels: the copy bandwidth (a 1 GiB elementwise pass, bytes read + written) and the bf16 matmul
rate (8192^3). Every timing is the median of several batches of jitted calls, divided by the calls (``--timer``:
CUPTI's kernel durations, or the host's wall clock over calls queued back to back); within a section the Pallas
variants are compiled side by side first, into the persistent cache in ``--cache-dir``. Floors: decode = bytes it
must read (K/V rows of every visible token + q + out) / copy bandwidth; prefill = causal FLOPs / matmul rate.
Shapes are Llama-3.1-8B / Mistral-7B attention; tuned defaults come from ``DECODE`` and ``PREFILL``; the whole
default set takes over 10 minutes on an H100, mostly compiling, so split it across calls with ``--only``. On a
machine without a GPU only the checks (in Pallas' interpreter) and the host cost of scheduling run."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable

import jax

from bench import compile_times, decode, harness, prefill, schedule
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.prefill.config import PREFILL, PrefillConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SECTIONS = "check_decode,decode,schedule,check_prefill,prefill,lpt"


@dataclasses.dataclass
class Run:
    """What the sections share: the command line, the random key, the decode config (``DECODE`` with ``--pack-tile``),
    the ceilings (None without a timed section), each rate's decode config, the prefill config and the results."""

    args: argparse.Namespace
    key: jax.Array
    config: DecodeConfig
    bw: float | None
    flops: float | None
    tuned: dict[float, DecodeConfig]
    prefill: PrefillConfig = PREFILL
    result: dict = dataclasses.field(default_factory=dict)

    @property
    def rates(self) -> tuple[float, ...]:
        """``--rates`` as numbers."""
        return tuple(float(r) for r in self.args.rates.split(","))

    @property
    def plans(self) -> tuple[str, ...]:
        """``--plans`` as a tuple of forms."""
        return tuple(self.args.plans.split(","))


def run_compile(run: Run):
    """The compile section: compile times into ``result['compile']``."""
    run.result["compile"] = compile_times.compile_times(run.key, run.args.match, run.config)


def run_widths(run: Run):
    """The widths section: decode bandwidth by head width (printed only)."""
    decode.width_sweep(run.key, run.bw, run.config)


def run_classes(run: Run):
    """The classes section: one launch per width class against one launch (printed only)."""
    layer = harness.pick_layer(harness.rank_plan(0.5, config=run.config), 0.5)
    decode.per_class_launches(run.key, run.bw, layer, config=run.config)


def run_autotune(run: Run):
    """The autotune section: each rate's fastest ``DECODE_SWEEP`` variant into ``tuned``."""
    batch, ctx = map(int, run.args.tune_shape.split("x"))
    configs = [dataclasses.replace(c, pack_tile=run.config.pack_tile) for c in decode.DECODE_SWEEP]
    run.tuned.update(decode.decode_autotune(run.key, run.bw, run.rates, batch, ctx, configs))
    run.result["decode_knobs"] = {r: dataclasses.asdict(c) for r, c in run.tuned.items()}


def run_check_decode(run: Run):
    """The check_decode section: decode check rows (in Pallas' interpreter without a GPU)."""
    run.result["decode_checks"] = decode.decode_checks(
        run.key, run.args.match, run.config, interpret=not harness.on_gpu()
    )


def run_decode(run: Run):
    """The decode section: the decode table's rows."""
    shapes = [(32, 4096)] if run.args.quick else [(32, 4096), (128, 4096), (1, 32768), (256, 512)]
    if run.args.shapes:
        shapes = [tuple(map(int, sh.split("x"))) for sh in run.args.shapes.split(",")]
    run.result["decode"] = decode.decode_table(
        run.key, run.bw, shapes, run.rates, run.args.quick, run.tuned, tuple(run.args.orders.split(",")), run.plans
    )


def run_schedules(run: Run):
    """The schedules section: schedule options' rows."""
    cases = [(0.5, 32, 4096), (0.7, 32, 4096), (0.5, 1, 32768), (0.5, 128, 4096)]
    run.result["schedules"] = schedule.schedule_table(run.key, run.bw, cases)


def run_schedule(run: Run):
    """The schedule section: the host cost of scheduling (a step estimated from the decode table's row)."""
    rows = {
        r["kernel"]: r["time_us"]
        for r in run.result.get("decode", [])
        if r["batch"] == 256 and r["ctx"] == 512 and r["rate"] == 0.5
    }
    per_layer = rows.get(f"kvjax {run.config.order}", rows.get("kvjax lpt"))
    run.result["schedule"] = schedule.schedule_cost(per_layer, run.bw, config=run.config)


def run_check_prefill(run: Run):
    """The check_prefill section: prefill check rows (in Pallas' interpreter without a GPU)."""
    run.result["prefill_checks"] = prefill.prefill_checks(
        run.key, run.args.match, run.config, interpret=not harness.on_gpu()
    )


def run_sweep(run: Run):
    """The sweep section: the fastest correct ``PREFILL_SWEEP`` variant, for the prefill table."""
    run.prefill = prefill.prefill_sweep(run.key, run.flops, decode=run.config)
    run.result["prefill_config"] = dataclasses.asdict(run.prefill)


def run_prefill(run: Run):
    """The prefill section: the prefill table's rows."""
    cases = (
        [(1, 4096, ((0.0, (True,)), (0.5, (True, False))))]
        if run.args.quick
        else [
            (1, 4096, ((0.0, (True,)), (0.5, (True, False)), (0.7, (True,)))),
            (1, 16384, ((0.0, ()), (0.5, (True,)))),
        ]
    )
    run.result["prefill"] = prefill.prefill_table(run.key, run.flops, cases, run.prefill, decode=run.config)


def run_lpt(run: Run):
    """The lpt section: the orders' rows on ragged batches."""
    cases = [(0.5, 32, 4096)] if run.args.quick else [(0.5, 128, 4096), (0.7, 8, 16384)]
    run.result["lpt"] = schedule.lpt_table(run.key, run.bw, cases, run.tuned, run.plans)


@dataclasses.dataclass(frozen=True)
class Section:
    """A section of the command line: whether it needs a GPU, what it runs (its module's function) and its runner."""

    gpu: bool
    what: str
    run: Callable[[Run], None]


SECTIONS = {  # in the order sections run
    "compile": Section(
        True, "compile_times.compile_times: XLA's compile time for modules calling the decode kernel", run_compile
    ),
    "widths": Section(
        True, "decode.width_sweep: decode bandwidth by head width, one padded tile or pieces per head", run_widths
    ),
    "classes": Section(
        True, "decode.per_class_launches: the rate-0.5 layer as one launch per width class", run_classes
    ),
    "autotune": Section(
        True,
        "decode.decode_autotune: DecodeConfig variants per rate at --tune-shape; the decode "
        "and lpt tables then use each rate's fastest",
        run_autotune,
    ),
    "check_decode": Section(False, "decode.decode_checks: the decode kernel against the reference", run_check_decode),
    "decode": Section(
        True, "decode.decode_table: decode beside its floor, JAX paged_attention, cuDNN and Palu", run_decode
    ),
    "schedules": Section(
        True, "schedule.schedule_table: schedule options side by side on one compiled kernel", run_schedules
    ),
    "schedule": Section(False, "schedule.schedule_cost: the host cost of scheduling", run_schedule),
    "check_prefill": Section(
        False,
        "prefill.prefill_checks: the prefill kernel (and its page writes) against the reference",
        run_check_prefill,
    ),
    "sweep": Section(
        True,
        "prefill.prefill_sweep: PrefillConfig variants at rate 0.5; the prefill table then uses "
        "the fastest correct one",
        run_sweep,
    ),
    "prefill": Section(
        True, "prefill.prefill_table: prefill balanced and unbalanced beside its floor and cuDNN", run_prefill
    ),
    "lpt": Section(True, "schedule.lpt_table: the orders on ragged batches", run_lpt),
}


def parser() -> argparse.ArgumentParser:
    """The command line (sections and their modules in the epilog)."""
    epilog = "sections (--only), in the order they run; GPU: needs one, CPU: runs on a CPU too:\n" + "\n".join(
        textwrap.fill(
            f"{'GPU' if sec.gpu else 'CPU'}  {sec.what}",
            118,
            initial_indent=f"  {name:<14}",
            subsequent_indent=" " * 21,
        )
        for name, sec in SECTIONS.items()
    )
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: one decode shape, one prefill shape")
    ap.add_argument("--profile", help="only run one decode call for ncu: uniform:W, rate:R or filled:R")
    ap.add_argument("--json", help="write all rows here")
    harness.timer_option(ap)
    ap.add_argument(
        "--shapes",
        help="decode shapes BxCTX, comma-separated (default: 32x4096,128x4096,1x32768,256x512; --quick: 32x4096)",
    )
    ap.add_argument("--tune-shape", default="32x4096", help="BxCTX the autotune section times its variants at")
    ap.add_argument("--rates", default="0,0.5,0.7", help="decode table rates, comma-separated")
    ap.add_argument("--orders", default="auto,stream,lpt,naive", help="decode table orders for compressed plans")
    ap.add_argument(
        "--plans",
        default="ordered,filled",
        help="forms of the rank plans for the decode and lpt tables, comma-separated: ordered (as "
        "compression stores them by default: heads ordered for runs), filled (compression's opt-in "
        "fill_tiles: widths also moved between heads so runs fill their tiles), drawn (the order "
        "drawn: the ablation)",
    )
    ap.add_argument(
        "--pack-tile",
        type=int,
        default=DECODE.pack_tile,
        help="widest tile a run of several heads reads (DecodeConfig.pack_tile of every decode config, "
        "and the tile the bench's plans order their heads for)",
    )
    ap.add_argument(
        "--match", default="", help="only the correctness cases (and compile rows) whose name contains this"
    )
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(ROOT, ".jaxcache"),
        help="JAX's persistent compilation cache (width-mixed kernels are slow to compile; a rerun of an "
        "unchanged kernel loads it from here); '' turns it off",
    )
    ap.add_argument(
        "--only",
        default=DEFAULT_SECTIONS,
        help=f"comma list of sections (below), run in their order (default: {DEFAULT_SECTIONS})",
    )
    return ap


def main(argv=None):
    """Run the sections asked for, in ``SECTIONS`` order, printing tables (and writing ``--json`` after each)."""
    ap = parser()
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if unknown := sorted(only - set(SECTIONS)):
        ap.error(f"unknown sections {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    harness.TIMER["name"] = args.timer
    config = dataclasses.replace(DECODE, pack_tile=args.pack_tile)
    gpu = harness.on_gpu()
    if args.profile:
        if not gpu:
            raise SystemExit(
                f"kernels.py: --profile runs one decode kernel for ncu and needs a GPU (JAX backend: "
                f"{jax.default_backend()})"
            )
        return decode.profile_one(args.profile, config)
    timed = [name for name, sec in SECTIONS.items() if name in only and sec.gpu]
    if timed and not gpu:
        cpu = [name for name, sec in SECTIONS.items() if not sec.gpu]
        raise SystemExit(
            f"kernels.py: sections {', '.join(timed)} run the compiled Triton kernels and need a GPU "
            f"(JAX backend: {jax.default_backend()}); without one, run only {', '.join(cpu)}"
        )
    dev = jax.devices()[0]
    print(
        f"device: {dev.device_kind} ({getattr(dev, 'core_count', '?')} SMs), jax {jax.__version__}, "
        f"{datetime.date.today()}, timer {args.timer}, command: {' '.join(sys.argv)}"
    )
    run = Run(args, jax.random.key(int(time.time())), config, None, None, {})
    run.tuned.update(dict.fromkeys((0.0, 0.5, 0.7, *run.rates), config))  # --only autotune picks per rate
    run.result["decode_knobs"] = {r: dataclasses.asdict(c) for r, c in run.tuned.items()}
    run.result.update(device=dev.device_kind, date=str(datetime.date.today()), argv=sys.argv, timer=args.timer)
    if timed:
        run.bw, run.flops = harness.copy_bandwidth(), harness.matmul_rate()
        print(
            f"measured copy bandwidth {run.bw / 1e12:.2f} TB/s (read+write), bf16 matmul {run.flops / 1e12:.0f} TFLOP/s"
        )
        run.result.update(copy_bw=run.bw, matmul=run.flops)
    for name, sec in SECTIONS.items():
        if name in only:
            sec.run(run)
            if args.json:  # after every section, so a cut-short run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(run.result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
