"""The errors kvjax raises for bad input it was handed, beside Python's own ``TypeError``/``ValueError``."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file or directory is corrupt, truncated, incomplete or inconsistent with its config.

    The message names the file (and the tensor or part) and what is wrong, in one line."""
