"""JAX's persistent compilation cache for kvjax's steps, so a machine compiles each step once, not every process
(issue 39, item 1): ``kvjax.generate``, ``kvjax-infer`` and ``kvjax-serve`` turn it on by default.

Where: ``$KVJAX_COMPILE_CACHE`` if set, else ``$XDG_CACHE_HOME/kvjax/jax`` (``~/.cache/kvjax/jax``), made private to
the user (JAX treats the cache as trusted code: whoever can write to it can run code in the process). A directory
already set through JAX's own ``jax_compilation_cache_dir`` is kept. ``"off"`` (the argument, the environment
variable, or the commands' ``--compile-cache off``) leaves JAX's cache as it is. JAX caches what compiles for longer
than ``jax_persistent_cache_min_compile_time_secs`` (1 s by default; ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
sets it): a step's XLA and Triton compile. Its tracing and lowering are kept beside, in ``steps/``
(``step_cache``), by the engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "KVJAX_COMPILE_CACHE"
OFF = "off"


def default_dir() -> Path:
    """The cache's directory when none is given: ``$KVJAX_COMPILE_CACHE``, else under the user's cache folder."""
    given = os.environ.get(ENV, "")
    if given and given != OFF:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvjax" / "jax"


def use(where: str | os.PathLike | None = None) -> Path | None:
    """Turn the persistent compilation cache on and return its directory, or None where it stays off.

    ``where``: a directory; None for the default (``default_dir``, or the directory JAX was already given);
    ``"off"`` to leave the cache alone. A directory that cannot be made is a one-line ValueError, anything else
    (a number, an empty string) a TypeError."""
    if where is not None and (not isinstance(where, (str, os.PathLike)) or not str(where)):
        raise TypeError(f"compile_cache must be a directory or 'off', got {where!r}")
    if where is None and os.environ.get(ENV) == OFF or where == OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if where is None and current:
        return Path(current)
    path = default_dir() if where is None else Path(where).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache {str(path)!r} cannot be made: {e.strerror or e}") from None
    if not path.is_dir() or not os.access(path, os.W_OK):
        raise ValueError(f"compile cache {str(path)!r} is not a writable directory")
    if current and Path(current) != path:
        from jax._src import compilation_cache  # the cache JAX opened at the old directory, closed

        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_enable_compilation_cache", True)
    return path
