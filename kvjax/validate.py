"""Checks of user input at the boundary, shared by the Python API, the command lines and (later) the server.

Every check returns the value normalised to a plain Python type or raises ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, bad value) with a message that names the argument and the value. Inside the library
values are then trusted: nothing past these checks re-validates them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

DTYPES = ("bfloat16", "float16", "float32")  # parameter and cache dtypes kvjax computes in


def _is_int(value) -> bool:
    """Python and NumPy integers; not bools (``True`` is an int to Python, never a count or a token to us)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """An integer in ``[low, high]`` (either bound optional)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def positive(name: str, value) -> int:
    """An integer >= 1."""
    value = integer(name, value)
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def number(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number between ``low`` and ``high`` (closed unless ``*_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "" if low is None else f"{'(' if low_open else '['}{low:g}, "
        hi = "" if high is None else f"{high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {lo or '(-inf, '}{hi or 'inf)'}, got {value:g}")
    return value


def rate(name: str, value) -> float:
    """A compression or removal rate: the fraction of something dropped, in [0, 1)."""
    return number(name, value, low=0.0, high=1.0, high_open=True)


def temperature(value) -> float:
    """Sampling temperature: 0 is greedy, else finite and positive."""
    return number("temperature", value, low=0.0)


def top_p(value) -> float:
    """Nucleus mass in (0, 1]."""
    return number("top_p", value, low=0.0, high=1.0, low_open=True)


def flag(name: str, value) -> bool:
    """A bool (Python or NumPy); ``"no"`` or ``1`` would be truthy or falsy by accident, so they are refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def seed(value) -> int:
    return integer("seed", value, low=0, high=2**63 - 1)


def dtype(value) -> str:
    """One of ``DTYPES``, given by name or as a NumPy/JAX dtype; returns its name."""
    try:
        name = np.dtype(value).name if not isinstance(value, str) else value
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    return name


def token_ids(name: str, ids, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    """A sequence of Python or NumPy integers in ``[0, vocab_size)``, as a list.

    Floats, bools, strings and bytes are refused rather than converted: ``int(2.7)`` or ``list(b"hi")`` would turn
    a caller's mistake into a valid-looking prompt."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise TypeError(f"{name} must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
        out = ids.astype(np.int64).tolist()
    else:
        bad = next((t for t in ids if not _is_int(t)), None)
        if bad is not None:
            raise TypeError(f"{name} must hold integer token ids, got {bad!r} ({type(bad).__name__})")
        out = [int(t) for t in ids]
    if not out and not allow_empty:
        raise ValueError(f"{name} must have at least one token")
    bad = next((t for t in out if not 0 <= t < vocab_size), None)
    if bad is not None:
        bounds = ">= 0" if vocab_size == float("inf") else f"in [0, {vocab_size})"
        raise ValueError(f"{name}: token ids must be {bounds}, got {bad}")
    return out


def unicode_text(name: str, value: str) -> str:
    """A string that is valid Unicode text: one with a lone surrogate (``"\\ud800"``, which no UTF-8 encodes, e.g.
    from a JSON escape) is a ``ValueError`` naming its character index."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode text: lone surrogate {value[e.start]!r} at character {e.start}"
        ) from None
    return value


def stops(stop) -> tuple[set[int], list[str]]:
    """Stop conditions -> (token ids, strings): one string or id, or a sequence of them (NumPy ints included)."""
    if stop is None:
        return set(), []
    items = [stop] if isinstance(stop, str) or _is_int(stop) else stop
    if not isinstance(items, (Sequence, np.ndarray)) or isinstance(items, (bytes, bytearray)):
        raise TypeError(f"stop must be a string, a token id or a list of them, got {type(stop).__name__}")
    ids, texts = set(), []
    for s in items:
        if isinstance(s, str):
            if not s:
                raise ValueError("stop strings must not be empty")
            texts.append(s)
        elif _is_int(s):
            ids.add(integer("stop token id", s, low=0))
        else:
            raise TypeError(f"stop entries must be strings or token ids, got {s!r} ({type(s).__name__})")
    return ids, texts


def memory_budget(name: str, value) -> float | int:
    """A memory budget: a float fraction in (0, 1] of the free device memory, or an int count of bytes >= 1."""
    if _is_int(value):
        return positive(f"{name} (bytes)", value)
    return number(f"{name} (a fraction of free device memory)", value, low=0, high=1, low_open=True)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str) -> float | int:
    """Command-line memory: "0.9" (a fraction of free device memory), "12GiB", "500MB" or a byte count."""
    number_part = text.strip().rstrip("BbIiKkMmGg ")
    unit = text.strip()[len(number_part) :].strip().lower()
    try:
        value = float(number_part)
    except ValueError:
        raise ValueError(f"memory must be a fraction such as 0.9 or a size such as 12GiB, got {text!r}") from None
    if unit not in _UNITS:
        raise ValueError(f"memory unit must be one of B, KB, MB, GB, KiB, MiB, GiB, got {text!r}")
    if not unit and value <= 1:
        return value
    if not unit and not value.is_integer():
        raise ValueError(f"memory without a unit is a fraction in (0, 1] or a whole number of bytes, got {text!r}")
    return round(value * _UNITS[unit])


def arg(check: Callable, parse: Callable = str) -> Callable:
    """An argparse ``type=``: parse the text, then ``check`` it; a failure is a usage error, not a traceback."""

    def convert(text: str):
        try:
            value = parse(text)
        except (TypeError, ValueError) as e:
            if parse in (int, float):  # Python's "invalid literal for int() with base 10" says little to a user
                kind = "an integer" if parse is int else "a number"
                raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
            raise argparse.ArgumentTypeError(str(e)) from None
        try:
            return check(value)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(check, "__name__", "value")  # argparse names the type in its messages
    return convert


def share_arg(words: dict) -> Callable[[str], object]:
    """An argparse ``type=`` for a share: a number strictly between 0 and 1, or one of ``words`` (text, any case ->
    the value it stands for); anything else is a usage error naming both."""
    options = " or ".join(repr(w) for w in words)

    def share(text: str):
        if text.lower() in words:
            return words[text.lower()]
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0.0 < value < 1.0:
            raise argparse.ArgumentTypeError(f"must be a number strictly between 0 and 1 or {options}, got {text!r}")
        return value

    return share


def int_fields(config, at_least_one=()) -> None:
    """Every int field of a config dataclass is an int (not a bool), >= 1 when named in ``at_least_one``, else >= 0;
    every bool field is a bool."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type in ("bool", bool) and not isinstance(value, bool):
            raise ValueError(f"{field.name} must be a bool, got {value!r}")
        if field.type not in ("int", int):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{field.name} must be an integer, got {value!r}")
        least = 1 if field.name in at_least_one else 0
        if value < least:
            raise ValueError(f"{field.name} must be at least {least}, got {value}")
