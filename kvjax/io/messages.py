"""How the checkpoint readers word what they read and refuse: a message cut to one line, a few names of many, and
a JSON file read with an error that names the file, line and column (``CheckpointError``)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from kvjax.errors import CheckpointError


def one_line(text) -> str:
    """The first line of ``text`` (an exception's message, say), cut to 300 characters."""
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= 300 else line[:297] + "..."


def some(names: Iterable[str], k: int = 3) -> str:
    """Up to ``k`` quoted names, and how many more there are."""
    names = list(names)
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return ", ".join(map(repr, names[:k])) + more


def read_json(path: str):
    """The parsed contents of a JSON file; a ``CheckpointError`` naming the file, line and column if it is invalid."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise json_error(path, e) from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not a text file ({one_line(e)})") from None


def json_error(path: str, e: json.JSONDecodeError) -> CheckpointError:
    return CheckpointError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
