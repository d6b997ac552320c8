"""Real text without the internet: English prose from Python's own ``pydoc_data.topics`` and Python code from the
standard library's sources, each split into a calibration part and a disjoint held-out part.

Calibration draws only on its part and evaluation only on the other, so no evaluation text was seen while choosing
rotations. ``domain_text`` names the two domains ("prose", "code"); ``kvjax.compress``'s default calibration
("text") alternates rows of both calibration parts.
"""

from __future__ import annotations

import importlib.util
import os

# Standard-library packages whose ``.py`` files make each part of ``stdlib_code``: disjoint top-level packages, so
# no file is in both parts.
CODE_PACKAGES = {
    "calibration": ("email", "json", "logging", "urllib"),
    "heldout": ("concurrent", "http", "wsgiref", "xmlrpc"),
}
_SKIP_DIRS = {"__pycache__", "test", "tests", "idle_test"}
DOMAINS = ("prose", "code")  # domain_text's domains, in the order calibration "text" alternates their rows


def _check_part(part: str) -> None:
    if part not in ("calibration", "heldout"):
        raise ValueError(f"part must be 'calibration' or 'heldout', got {part!r}")


def pydoc_text(part: str) -> str:
    """``part`` "calibration" (first half of the characters) or "heldout" (second half)."""
    from pydoc_data.topics import topics

    _check_part(part)
    text = "\n\n".join(topics[k] for k in sorted(topics))
    half = len(text) // 2
    return text[:half] if part == "calibration" else text[half:]


def _package_dir(package: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None or os.path.basename(spec.origin) != "__init__.py":
        raise RuntimeError(f"standard-library package {package!r} has no Python source here")
    return os.path.dirname(spec.origin)


def stdlib_code_files(part: str) -> list[str]:
    """``part``'s ``.py`` files as sorted paths relative to the standard library ("email/utils.py", ...)."""
    _check_part(part)
    files = []
    for package in CODE_PACKAGES[part]:
        top = _package_dir(package)
        for folder, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
            rel = os.path.relpath(folder, os.path.dirname(top)).replace(os.sep, "/")
            files += [f"{rel}/{n}" for n in names if n.endswith(".py")]
    return sorted(files)


def stdlib_code(part: str) -> str:
    """Python code (PSF License, shipped with the interpreter): ``part``'s files in order, each after a ``# path``."""
    chunks = []
    for rel in stdlib_code_files(part):
        top = _package_dir(rel.split("/")[0])
        with open(os.path.join(os.path.dirname(top), *rel.split("/")), encoding="utf-8") as f:
            chunks.append(f"# {rel}\n{f.read()}")
    return "\n\n".join(chunks)


def domain_text(domain: str, part: str) -> str:
    """``part`` of ``domain``: "prose" (``pydoc_text``) or "code" (``stdlib_code``)."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    return pydoc_text(part) if domain == "prose" else stdlib_code(part)


def check_text_file(path: str) -> None:
    """``path`` is a file that can be read as calibration text: a missing path, a directory or anything else that
    is not a regular file is an ``OSError`` naming it."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"calibration text file {path!r} is a directory, not a file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"calibration text file {path!r} does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"calibration text file {path!r} is not a regular file")


def read_text_file(path: str) -> str:
    """The UTF-8 text of the calibration file ``path``; bytes that are not UTF-8 are a ``ValueError`` naming the
    file and the offset of the first bad byte."""
    check_text_file(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"calibration text file {path!r} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
            f"({e.reason})"
        ) from None
