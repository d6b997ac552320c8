"""Fingerprint of what kvjax produces, to show a refactor changed no output: ``python scripts/fingerprint.py OUT.json``.

Records greedy tokens of ``kvjax.generate`` (uncompressed, ZACK, ZACK with filled tiles, Palu), the rank plans
``kvjax.compress`` makes (summary and JSON), what ``kvjax-convert`` writes, and hashes of the decode schedule's
tables for random layouts and lengths, on SmolLM2 and the test fixtures. Compare two runs with ``diff``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
PROMPTS = [[5, 17, 33, 2, 61], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [3]]
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.shape).encode() + str(a.dtype).encode() + a.tobytes())
    return h.hexdigest()[:16]


def tokens(gens) -> list[list[int]]:
    return [list(map(int, g.tokens)) for g in gens]


def model_outputs(kvjax, model, prompts, backends, new_tokens) -> dict:
    out = {}
    for backend in backends:
        out[f"generate/{backend}"] = tokens(
            kvjax.generate(model, prompts, max_new_tokens=new_tokens, backend=backend, max_seq_len=128)
        )
    return out


def compressed(kvjax, model, prompts, backends, new_tokens, num_tokens, calibration="text") -> dict:
    out = {}
    for name, kwargs in (
        ("zack0.5", dict(target_rate=0.5)),
        ("zack0.5-fill", dict(target_rate=0.5, fill_tiles=True)),
        ("palu0.5", dict(target_rate=0.5, method="palu")),
    ):
        small = kvjax.compress(
            model,
            num_tokens=num_tokens,
            seq_len=min(128, num_tokens),
            calibration=calibration,
            progress=False,
            **kwargs,
        )
        out[name] = dict(
            summary=small.plan.summary(),
            plan=json.loads(small.plan.to_json())["k_qk"],
            v=json.loads(small.plan.to_json())["k_v"],
            order=json.loads(small.plan.to_json())["head_order"],
            **model_outputs(kvjax, small, prompts, backends, new_tokens),
        )
    return out


def converted(source: str) -> dict:
    import kvjax
    from kvjax.cli import convert

    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "out")
        convert.main(
            [source, dest, "--target-rate", "0.5", "--num-tokens", "256", "--seq-len", "64", "--dtype", "float32"]
        )
        model = kvjax.load(dest, dtype="float32", progress=False)
        return dict(plan=model.plan.summary(), **model_outputs(kvjax, model, SMOL_PROMPTS, ("reference",), 8))


def schedules() -> dict:
    import dataclasses

    from kvjax.layout import HeadLayout
    from kvjax.ops.decode import search, units
    from kvjax.ops.decode.config import DECODE

    try:
        from kvjax.ops.decode.schedule import build_decode_schedule, fixed_chunk_schedule
    except ImportError:  # before 2026-12-04 the module was ``plan``: the same script fingerprints both sides
        from kvjax.ops.decode.plan import build_decode_schedule, fixed_chunk_schedule  # type: ignore[no-redef]

    rng = np.random.default_rng(7)
    out = {}
    for case in range(12):
        kv = int(rng.choice([2, 4, 8]))
        g = int(rng.choice([1, 2, 4]))
        k = tuple(int(x) for x in rng.choice([16, 32, 48, 64, 80, 96, 112, 128], kv))
        v = tuple(int(x) for x in rng.choice([16, 32, 48, 64, 80, 96, 112, 128], kv))
        lay = HeadLayout(kv * g, kv, 128, k, v, None if case % 4 else 64)
        lengths = rng.integers(0, 3000, int(rng.choice([1, 4, 32])))
        rec = dict(
            runs=str(units.head_runs(lay)),
            order=search.order_heads(lay),
            fill=search.fill_runs(lay),
            loaded=search.loaded_cost(lay),
        )
        for order in ("auto", "lpt", "stream", "naive"):
            config = dataclasses.replace(DECODE, order=order)
            p = build_decode_schedule(lengths, [lay, lay], 16, 64, config=config, headroom_pages=2)
            s = p.schedule
            rec[order] = digest(s.items, s.counts, s.merge_dest, s.merge_range, p.loads, p.capacity)
        p = fixed_chunk_schedule(lengths, [lay], 16, 64, chunk_pages=32, splits=16)
        rec["fixed"] = digest(
            p.schedule.items, p.schedule.counts, p.schedule.merge_dest, p.schedule.merge_range, p.loads
        )
        out[str(case)] = rec
    return out


def main(path: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import kvjax

    result = {"schedules": schedules()}
    for name in ("llama", "mistral", "falcon_new"):
        fixture = os.path.join(FIXTURES, name)
        model = kvjax.load(fixture, dtype="float32", progress=False)
        result[name] = model_outputs(kvjax, model, PROMPTS, ("reference", "interpret"), 8)
    for arch, window in (("llama", None), ("mistral", 24)):  # head_dim 64: the fixtures' 16 cannot shrink
        config = kvjax.ModelConfig(
            arch=arch,
            num_layers=2,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            hidden_size=128,
            intermediate_size=192,
            vocab_size=97,
            norm_eps=1e-5,
            max_position_embeddings=256,
            eos_token_ids=(),
            sliding_window=window,
        )
        model = kvjax.Model.random(config, seed=3)
        rec = model_outputs(kvjax, model, PROMPTS, ("reference", "interpret"), 8)
        rec.update(compressed(kvjax, model, PROMPTS, ("reference", "interpret"), 8, 512, calibration="random"))
        result[f"random-{arch}"] = rec
    result["convert/smollm2"] = converted("smollm2")
    smol = kvjax.load("smollm2", dtype="float32", progress=False)
    rec = model_outputs(kvjax, smol, SMOL_PROMPTS, ("reference",), 16)
    rec.update(compressed(kvjax, smol, SMOL_PROMPTS, ("reference",), 16, 1024))
    result["smollm2"] = rec
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
