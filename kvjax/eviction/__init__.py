"""Eviction of cached tokens per KV head (issue 37): metrics (``metrics``), budgets and selection (``select``), and
the teacher-forced reference (``reference``)."""

from kvjax.eviction.select import Eviction, parse

__all__ = ["Eviction", "parse"]
