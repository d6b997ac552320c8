"""What the machine at hand gives this process: its platform, the memory it may still use, and the defaults that
follow from them.

On a GPU the memory is the device allocator's (its limit less what is live). On a CPU it is the host's memory
available to this process: the least of the kernel's estimate of memory available without swapping
(``MemAvailable``) and what the process's cgroup still allows (a container's or a systemd slice's limit less its
usage), since either can be the one that kills it. ``KVJAX_MEMORY`` (a size such as ``2GiB``) caps both, for an
operator on a shared host and for tests that play a small machine.

Defaults take only a share of it (``SHARE``): a GPU is the process's own, a CPU host is shared with the OS, the
compiler (XLA's CPU compiles of a step take hundreds of MB) and whatever else runs there.
"""

from __future__ import annotations

import os

import jax

from kvjax import validate

ENV = "KVJAX_MEMORY"  # caps the memory kvjax believes this process may use (a size: "2GiB", "512MB")
SHARE = {"gpu": 0.9, "cpu": 0.5}  # of the memory available, for the KV cache and a step's activations
# CPU defaults: the jnp attention path reads every page of a sequence's block table at every step, so a step's cost
# follows max_batch x max_seq_len; these keep a small model's step well under a second on two cores
CPU_MAX_BATCH, CPU_MAX_SEQ_LEN = 4, 2048
GPU_MAX_BATCH, GPU_MAX_SEQ_LEN = 32, 8192  # a GPU's: the shapes its steps were measured at (bench/results/engine.md)
F32_SHARE = 0.25  # on a CPU, float32 parameters by default only while they take at most this share of the memory


def platform(device=None) -> str:
    """ "gpu" for a CUDA/ROCm device, "cpu" otherwise (an interpreted or unknown device plans as a CPU does)."""
    return "gpu" if (device or jax.devices()[0]).platform in ("gpu", "cuda", "rocm") else "cpu"


def default_max_batch(device=None) -> int:
    """Sequences decoded at once where the caller gives none: ``GPU_MAX_BATCH`` on a GPU, ``CPU_MAX_BATCH`` on a
    CPU. ``kvjax.generate``, ``kvjax-infer`` and ``kvjax-serve`` all default to it."""
    return GPU_MAX_BATCH if platform(device) == "gpu" else CPU_MAX_BATCH


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) and unreadable values are no limit


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup still allows: its limit less its usage (v2, then v1), or None without a limit."""
    group = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0":  # the v2 unified hierarchy's entry
                    group = parts[2].lstrip("/")
    except OSError:
        pass
    rooms = []
    for where in {os.path.join(root, group), root}:
        limit, usage = _read_int(os.path.join(where, "memory.max")), _read_int(os.path.join(where, "memory.current"))
        if limit is not None and usage is not None:
            rooms.append(limit - usage)
    v1 = os.path.join(root, "memory")
    limit, usage = (
        _read_int(os.path.join(v1, "memory.limit_in_bytes")),
        _read_int(os.path.join(v1, "memory.usage_in_bytes")),
    )
    if limit is not None and usage is not None and limit < 2**60:  # v1 says "no limit" with a huge number
        rooms.append(limit - usage)
    return max(0, min(rooms)) if rooms else None


def env_cap() -> int | None:
    """``KVJAX_MEMORY`` in bytes, or None where it is unset; a value that is not a size is a clear error."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        value = validate.parse_memory(text)
    except ValueError as e:
        raise ValueError(f"{ENV}={text!r}: {e}") from None
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{ENV}={text!r} must be a positive size such as 2GiB")
    return value


def host_available() -> int | None:
    """Host memory this process may still use: the least of MemAvailable and its cgroup's room (None: unknown)."""
    known = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    return min(known) if known else None


def available_bytes(device=None) -> int | None:
    """Memory this process may still use for new arrays: on a GPU the allocator's limit less what is live, on a
    CPU ``host_available``; capped by ``KVJAX_MEMORY``. None only where nothing says (no GPU statistics, no
    /proc)."""
    device = device or jax.devices()[0]
    found: int | None
    if platform(device) == "gpu":
        stats = device.memory_stats() or {}
        found = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)) if "bytes_limit" in stats else None
    else:
        found = host_available()
    cap = env_cap()
    if cap is None:
        return found
    return cap if found is None else min(cap, found)


def default_dtype(param_count: int, device=None) -> str:
    """The parameter dtype a model gets when none is asked for: bfloat16 on a GPU; on a CPU float32, whose answers
    are the model's own (bfloat16's rounding flips a small model's greedy tokens with the batch: bench/results/engine.md
    "Batch invariance"), unless its parameters would take more than ``F32_SHARE`` of the memory available."""
    if platform(device) == "gpu":
        return "bfloat16"
    room = available_bytes(device)
    return "float32" if room is None or 4 * param_count <= F32_SHARE * room else "bfloat16"


def param_dtype(dtype, param_count: int) -> str:
    """The parameter dtype a load asks for, by name: ``default_dtype`` for "auto", else ``dtype`` checked
    (``kvjax.validate.DTYPES``). Loaders call it once they have read the model's config, so "auto" costs no
    second read of the checkpoint."""
    if isinstance(dtype, str) and dtype == "auto":
        return default_dtype(param_count)
    return validate.dtype(dtype)
