"""Bench outputs on disk whole or not at all: every JSON and PNG a benchmark writes goes through here, so a run
cut short (a device call's time limit, Ctrl-C) leaves the previous file or none, never half of one; and the plots'
reading of those JSONs back (``read_accuracy_jsons``)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
from collections.abc import Callable


def write_atomic(path: str, write: Callable, mode: str = "w") -> None:
    """Write ``path`` whole or not at all: ``write(file)`` fills a temporary sibling, renamed over ``path`` last."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, mode) as f:
            os.fchmod(f.fileno(), 0o666 & ~umask)  # what open() would give, not mkstemp's owner-only 0600
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, data, indent: int | None = None) -> None:
    """``data`` as JSON at ``path``, whole or not at all."""
    write_atomic(path, lambda f: json.dump(data, f, indent=indent))


def json_folder(parser: argparse.ArgumentParser, path: str | None) -> None:
    """Make the folder of ``path`` (a ``--json`` argument; None: nothing) now, or stop with ``parser``'s one-line
    error: a bad path fails before the work, not after it."""
    if path:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        except OSError as e:
            parser.error(f"--json: {e}")


def read_accuracy_jsons(parser: argparse.ArgumentParser, names: list[str], mode: str) -> tuple[list[dict], str | None]:
    """The row (eval) or run (retrieval) lists of ``bench/accuracy.py`` JSONs of ``mode`` joined in
    order, and the first one's model; a file that cannot be read or holds another mode is ``parser``'s usage error.
    A name ending ".gz" is read through gzip (the committed results of long grids are kept compressed)."""
    key = {"eval": "rows", "retrieval": "runs"}[mode]
    items: list[dict] = []
    model = None
    for name in names:
        try:
            with (gzip.open if name.endswith(".gz") else open)(name, "rt", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, EOFError) as e:  # EOFError: a cut gzip file
            parser.error(f"{name}: {e}")
        if not isinstance(data, dict) or data.get("mode") != mode or key not in data:
            parser.error(f"{name} is not a bench/accuracy.py {mode} JSON")
        items += data[key]
        model = model or data.get("args", {}).get("model")
    return items, model
