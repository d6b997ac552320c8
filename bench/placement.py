"""Tensor parallelism's head placement (issue 38: "placement imbalance at most 1.05 on random rate-0.5 layouts of the
Llama-3.1-70B shape"): for rank plans of the 70B shape (80 layers, 8 KV heads of 128; ``harness.rank_plan``'s
log-normal widths, as compression stores them ("ordered": each layer's heads in the decode op's order) or as drawn),
the byte-balanced placement (``kvjax.parallel.placement.place``) against the even-count split that shards the
packed heads in order (``even``), on 2, 4 and 8 devices. Per row, over ``--seeds`` plans: the memory imbalance (max
over mean of each device's bytes per token summed over layers: its page pool) and the step imbalance (each layer's
slowest device summed over layers, over a perfect split: decode attention time), and the padded imbalance (one
local layout for the one SPMD program, each local head as wide as the widest device's: what a forward over padded
local layouts reads, ``shards.padded_imbalance``), mean and worst.

Host arithmetic only, in bf16 bytes: the same on any machine. Table: bench/results/parallel.md "Tensor parallelism: head
placement"."""

from __future__ import annotations

import argparse
import os

import numpy as np

from bench.files import write_json
from bench.harness import HKV, count_arg, print_table, rank_plan, rates_arg
from kvjax.parallel.placement import even, layout_bytes, place
from kvjax.parallel.shards import padded_imbalance

LAYERS_70B = 80


def rows_for(rate: float, form: str, devices: int, seeds: int) -> list[dict]:
    """Two rows (even, balanced) for ``seeds`` plans at ``rate`` in ``form`` on ``devices``."""
    found: dict = {"even": [], "balanced": []}
    for seed in range(seeds):
        layouts = list(rank_plan(rate, LAYERS_70B, seed=seed, form=form))
        cost = layout_bytes(layouts)
        for name, how in (("even", even), ("balanced", place)):
            p = how(cost, devices)
            found[name].append((p.memory_imbalance(), p.step_imbalance(), padded_imbalance(layouts, p)))
    rows = []
    for name, pairs in found.items():
        mem, step, padded = np.array(pairs).T
        rows.append(
            dict(rate=rate, form=form, devices=devices, placement=name, plans=seeds)
            | dict(memory_mean=round(mem.mean(), 4), memory_worst=round(mem.max(), 4))
            | dict(step_mean=round(step.mean(), 4), step_worst=round(step.max(), 4))
            | dict(padded_mean=round(padded.mean(), 4), padded_worst=round(padded.max(), 4))
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=rates_arg(), default=[0.5], help="comma-separated (default 0.5)")
    p.add_argument("--devices", type=count_arg("--devices"), nargs="+", default=[2, 4, 8])
    p.add_argument("--forms", nargs="+", choices=("ordered", "drawn"), default=["ordered", "drawn"])
    p.add_argument("--seeds", type=count_arg("--seeds"), default=20, help="random plans a row (default 20)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if bad := [n for n in args.devices if not (HKV % n == 0 or n % HKV == 0)]:
        p.error(f"--devices {bad[0]}: the {HKV} KV heads must be shared out evenly (a divisor or a multiple of {HKV})")
    if args.json and not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK):
        p.error(f"--json {args.json}: its folder is not a writable directory")
    rows = [
        row
        for rate in args.rates
        for form in args.forms
        for devices in args.devices
        for row in rows_for(rate, form, devices, args.seeds)
    ]
    print_table(rows)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
