"""bench/plot_retrieval.py (several models' retrieval runs in one heat map) and bench/plot_accuracy.py (perplexity
and KL against the rate), read from bench/accuracy.py JSONs."""

import gzip
import json

import pytest

from bench import plot_retrieval  # noqa: E402

pytest.importorskip("matplotlib")


def _run(variant, target, rate, task="passkey", contexts=(1024, 2048), depths=(0.0, 1.0), correct=None):
    cells = [
        {"context": c, "depth": d, "trials": 4, "correct": k, "accuracy": k / 4}
        for (c, d), k in zip([(c, d) for c in contexts for d in depths], correct, strict=True)
    ]
    results = {"trials": 4, "depths": list(depths), "contexts": list(contexts), "cells": cells}
    return {
        "calibration": "text",
        "variant": variant,
        "max_context": None,
        "k_share": None,
        "target_rate": target,
        "rate": rate,
        "task": task,
        "results": results,
    }


def test_rows_put_the_uncompressed_model_first_once_then_variants_by_rate():
    base = _run("uncompressed", 0.0, 0.0, correct=[4, 3, 2, 1])
    runs = [
        _run("zack", 0.5, 0.5, correct=[0, 0, 0, 1]),
        base,
        _run("zack", 0.1, 0.1014, correct=[4, 4, 4, 4]),
        base,
        _run("zack", 0.1, 0.1014, task="multikey", correct=[1, 1, 1, 1]),
    ]
    labels, depths, grid = plot_retrieval.grid_rows(runs, "passkey")
    assert depths == [0.0, 1.0]
    assert labels == [
        "uncompressed, 1024",
        "uncompressed, 2048",
        "zack p=0.10, 1024",
        "zack p=0.10, 2048",
        "zack p=0.50, 1024",
        "zack p=0.50, 2048",
    ]
    assert grid.tolist() == [[1.0, 0.75], [0.5, 0.25], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.25]]


def test_a_grid_split_by_context_reads_as_one_and_its_table_finds_the_largest_rate_within_tolerance():
    base_a = _run("uncompressed", 0.0, 0.0, contexts=(1024,), correct=[4, 4])
    base_b = _run("uncompressed", 0.0, 0.0, contexts=(8192,), correct=[4, 2])
    runs = [  # two files: contexts 1K and 8K, each with its own copy of the uncompressed run
        base_a,
        _run("zack", 0.1, 0.1014, contexts=(1024,), correct=[4, 4]),
        _run("zack", 0.5, 0.5, contexts=(1024,), correct=[4, 3]),
        base_b,
        _run("uncompressed", 0.0, 0.0, contexts=(1024,), correct=[0, 0]),  # a repeat of 1K: the first one counts
        _run("zack", 0.1, 0.1014, contexts=(8192,), correct=[3, 2]),
        _run("zack", 0.5, 0.5, contexts=(8192,), correct=[4, 2]),
    ]
    labels, _, grid = plot_retrieval.grid_rows(runs, "passkey")
    assert labels == [f"{m}, {c}" for m in ("uncompressed", "zack p=0.10", "zack p=0.50") for c in (1024, 8192)]
    assert grid.tolist() == [[1.0, 1.0], [1.0, 0.5], [1.0, 1.0], [0.75, 0.5], [1.0, 0.75], [1.0, 0.5]]
    lines = plot_retrieval.table(runs, "passkey", tolerance=0.1)
    assert "| uncompressed | 0.000 | 1.000 | 0.750 |" in lines and "| zack | 0.101 | 1.000 | 0.625 |" in lines
    # 1K: 0.5 is 12.5 points short; 8K: 0.1 is 12.5 points short, so 0.5 does not count though it is level
    assert lines[-1] == "| zack | 0.1 | 0 |"
    lines = plot_retrieval.table([*runs, _run("palu", 0.2, 0.2, contexts=(1024,), correct=[4, 4])], "passkey", 0.1)
    assert "| palu | 0.200 | 1.000 | - |" in lines and lines[-2] == "| palu | 0.2 | 0 |"  # no 8K run: no rate there
    # depth 0 alone: at 1K zack 0.5 (4 of 4) is level with the base, so it counts there; 8K fails at 0.1 already
    lines = plot_retrieval.table(runs, "passkey", tolerance=0.1, depths=[0.0])
    assert "| uncompressed | 0.000 | 1.000 | 1.000 |" in lines and lines[-1] == "| zack | 0.5 | 0 |"


def test_the_command_writes_a_png_and_refuses_what_it_cannot_draw(tmp_path, capsys):
    data = {
        "mode": "retrieval",
        "args": {"model": "tiny"},
        "runs": [_run("uncompressed", 0.0, 0.0, correct=[4, 3, 2, 1]), _run("palu", 0.2, 0.2, correct=[1] * 4)],
    }
    src = tmp_path / "r.json"
    src.write_text(json.dumps(data))
    out = tmp_path / "new" / "map.png"  # its folder is made
    assert plot_retrieval.main([str(src), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    packed = tmp_path / "r.json.gz"  # the committed long grids are gzipped
    packed.write_bytes(gzip.compress(src.read_bytes()))
    assert plot_retrieval.main([str(packed), "--out", str(tmp_path / "gz.png"), "--markdown"]) == 0
    assert "| palu | 0.200 | 0.250 | 0.250 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a depth the runs lack: refused before any PNG is written
        plot_retrieval.main([str(src), "--out", str(tmp_path / "d.png"), "--markdown", "--mean-depths", "0.3"])
    assert "--mean-depths must be some of" in capsys.readouterr().err and not (tmp_path / "d.png").exists()
    (tmp_path / "cut.json.gz").write_bytes(packed.read_bytes()[:40])
    with pytest.raises(SystemExit):
        plot_retrieval.main([str(tmp_path / "cut.json.gz"), "--out", str(tmp_path / "cut.png")])
    assert "cut.json.gz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_retrieval.main([str(src), "--task", "multikey", "--out", str(tmp_path / "none.png")])
    assert "no run of task 'multikey'" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"mode": "eval"}')
    with pytest.raises(SystemExit):
        plot_retrieval.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "x.png")])
    assert "is not a bench/accuracy.py retrieval JSON" in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists() and not (tmp_path / "x.png").exists()


def test_accuracy_curves_keep_grid_rows_of_one_window_and_one_point_a_rate():
    from bench import plot_accuracy

    def row(variant, rate, ppl, window=4096, probe=False, source="prose"):
        return {
            "source": source,
            "window": window,
            "variant": variant,
            "k_share": None,
            "rate": rate,
            "ppl": ppl,
            "kl": ppl / 10,
            "probe": probe,
        }

    rows = [
        row("uncompressed", 0.0, 9.0),
        row("zack", 0.3, 15.0),
        row("zack", 0.1, 10.0),
        row("zack", 0.05, 9.5, probe=True),
        row("zack", 0.1, 11.0, window=1024),
        row("palu-uniform", 0.25, 11.0),
        row("palu-uniform", 0.25, 11.0),
    ]
    assert plot_accuracy.curves(rows, 4096) == {
        "prose": {"base": 9.0, "zack": [(0.1, 10.0, 1.0), (0.3, 15.0, 1.5)], "palu-uniform": [(0.25, 11.0, 1.1)]}
    }
    with pytest.raises(ValueError, match="no rows at window 512"):
        plot_accuracy.curves(rows, 512)
