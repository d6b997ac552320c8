"""Saving and loading kvjax checkpoints: ``kvjax.json`` (config), ``plan.json`` (rank plan, if compressed),
``params/`` (an orbax checkpoint of the Flax parameters) and ``tokenizer/``. Written so that no failure loses data:
built in a sibling directory and swapped in by renames (``kvjax.io.atomic``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import machine
from kvjax.errors import CheckpointError
from kvjax.io import atomic
from kvjax.io.messages import json_error, one_line, read_json, some

# 2: a ZACK layer's qk_rotation is [d, k_cols] (``models.rotation``); format 1 stored it per group, zero-padded to
# the widest group, [Hkv, d, W], and loads as such, converted.
FORMAT = 2
# kvjax.json may also hold "serving": {"kv_bits": 4, 2 or a GEAR name such as "gear2-r1-o0.01"}, how the model is
# served by default (``Model.kv_bits``; absent or null: pages of the cache's dtype). It was added within format 2: a
# kvjax that predates it ignores the key and serves the checkpoint from unquantized pages, which is still correct,
# only larger (one that predates GEAR pages refuses a GEAR name with a CheckpointError). It is not under the digest:
# it says nothing about the weights, and editing it by hand is allowed (a bad value is a CheckpointError).
SERVING = "serving"
PARTS = ("kvjax.json", "plan.json", "params", "tokenizer")  # everything a checkpoint directory may hold


def save(model, directory: str, *, overwrite: bool = False, hint: str = "overwrite=True") -> str:
    """Write ``model`` to ``directory`` so that no failure loses data (``kvjax.io.atomic``); returns its absolute path.

    ``kvjax.json`` is written last: it marks the new directory complete. ``hint`` names the overwrite switch in
    errors (the converter's is ``--overwrite``)."""
    import orbax.checkpoint as ocp
    from flax.traverse_util import unflatten_dict

    from kvjax.compression.plan import check_kv_bits
    from kvjax.models.transformer import separate_params

    kv_bits = check_kv_bits(model.kv_bits, model.module.method, model.module.band)  # before any write
    for line in atomic.recover(os.path.abspath(directory), is_kvjax_checkpoint):
        warnings.warn(line, stacklevel=2)
    sources = () if model.source is None else (model.source,)
    directory = check_target(directory, overwrite=overwrite, sources=sources, hint=hint)
    params = unflatten_dict(separate_params(model.module))
    _check_room(params, directory)
    tmp = atomic.temp_dir(directory)
    try:
        parts = ["params"]
        checkpointer = ocp.StandardCheckpointer()
        with _orbax_noise(("write_fragment",)):
            checkpointer.save(os.path.join(tmp, "params"), params)
            checkpointer.wait_until_finished()
        if model.plan is not None:
            _write(os.path.join(tmp, "plan.json"), model.plan.to_json())
            parts.append("plan.json")
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
            parts.append("tokenizer")
        meta = {"format": FORMAT, "config": model.config.to_dict(), "dtype": str(model.dtype), "parts": parts}
        if kv_bits is not None:
            meta[SERVING] = {"kv_bits": kv_bits}
        meta["digest"] = config_digest(meta)
        _write(os.path.join(tmp, "kvjax.json"), json.dumps(meta, indent=1))
        atomic.commit(tmp, directory)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        error = _write_error(e, directory)
        if error is None:
            raise
        _drop_echoes(tmp)
        raise error from None
    return directory


def _check_room(params, directory: str) -> None:
    """Refuse, before writing anything, a save that cannot fit: fewer bytes free beside ``directory`` than half its
    parameters' (orbax compresses with zstd; a float32 copy of bf16 weights, whose low halves are zero, is the
    most compressible case, at about half). A save that passes may still fill the disk: ``_write_error``."""
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)) // 2
    free = shutil.disk_usage(os.path.dirname(directory)).free
    if free < need:
        error = OSError(
            f"no space left on device while writing {directory}: it needs at least {_size(need)}, "
            f"{_size(free)} are free; nothing there was changed"
        )
        error.errno = errno.ENOSPC
        raise error


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit that leaves at least 1: "300 KiB", "1.5 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _drop_echoes(tmp: str) -> None:
    """After a failed save: orbax's threads and tasks still failing on ``tmp`` (each write that hit the full disk)
    report the error again when they end (a thread's or a task's last-chance handler, a log line), possibly after
    our own error has printed. Every such report naming ``tmp``, now deleted, is a copy of the error raised: drop
    it."""

    def echo(value) -> bool:
        return tmp in str(value)

    previous_thread, previous_unraisable = threading.excepthook, sys.unraisablehook
    threading.excepthook = lambda a: None if echo(a.exc_value) else previous_thread(a)
    sys.unraisablehook = lambda u: None if echo(u.exc_value) or echo(u.object) else previous_unraisable(u)
    for name in ("asyncio", "absl"):
        logging.getLogger(name).addFilter(
            lambda record: not (echo(record.getMessage()) or (record.exc_info and echo(record.exc_info[1])))
        )


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from or during (at most 10): orbax wraps TensorStore's."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _write_error(error: BaseException, directory: str) -> OSError | None:
    """The operating system's error behind a failed save (orbax reports a failed write as a ValueError carrying
    the ``os_error_code``), as one ``OSError`` line naming ``directory``, e.g. "no space left on device while
    writing DIR"; None when the failure is no such error."""
    for err in _chain(error):
        found = re.search(r"os_error_code='(\d+)'", str(err))
        code = err.errno if isinstance(err, OSError) and err.errno else int(found[1]) if found else None
        if code:
            reason = os.strerror(code)
            out = OSError(f"{reason[:1].lower()}{reason[1:]} while writing {directory}; nothing there was changed")
            out.errno = code
            return out
    return None


def config_digest(meta: dict) -> str:
    """A digest of what ``kvjax.json`` says about the weights (its config and dtype), written beside them at save
    time: a hand edit of either no longer matches it."""
    canonical = json.dumps(
        {"config": meta.get("config"), "dtype": meta.get("dtype")}, sort_keys=True, separators=(",", ":")
    )
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _write(path: str, text: str) -> None:
    """Write ``text`` and flush it to disk before returning."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_target(
    directory: str, *, overwrite: bool, sources: tuple[str, ...] = (), hint: str = "overwrite=True"
) -> str:
    """The absolute ``directory`` if ``save`` may write there (``atomic.check_target``: an existing one only with
    ``overwrite``, and only if empty or a kvjax checkpoint holding nothing else), else a clear error."""
    return atomic.check_target(
        directory, overwrite=overwrite, replaceable=_replaceable, what="kvjax checkpoint", sources=sources, hint=hint
    )


def _replaceable(directory: str) -> bool:
    """A kvjax checkpoint holding nothing else: the only kind of directory ``save`` may replace."""
    return is_kvjax_checkpoint(directory) and set(os.listdir(directory)) <= set(PARTS)


def is_kvjax_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "kvjax.json"))


@dataclasses.dataclass
class _Checked:
    """A checkpoint's parts, read and checked against each other with no weight read (``_checked``)."""

    cfg: Any  # ModelConfig
    saved_dtype: Any
    fmt: int
    kv_bits: int | str | None
    plan: Any  # RankPlan or None
    module: Any  # the Transformer of shapes its config and plan build, in the saved dtype
    abstract: dict  # its parameters' shapes (format 1's rotations in their old shape), as orbax restores them
    checkpointer: object
    params_dir: str


def _checked(directory: str, sharded: bool = False) -> _Checked:
    """Every part of the checkpoint at ``directory`` but its weights, read and checked (``load_saved``'s errors);
    ``sharded``: to be read spread over devices, which a format-1 checkpoint cannot be."""
    import orbax.checkpoint as ocp

    from kvjax.models.transformer import Transformer

    plan_file, params_dir = os.path.join(directory, "plan.json"), os.path.join(directory, "params")
    cfg, saved_dtype, parts, fmt, kv_bits = _read_meta(directory)
    if sharded and fmt == 1:
        raise CheckpointError(f"{directory}: a format-1 checkpoint is read whole; save it again to read it sharded")
    plan = _read_plan(plan_file)
    if kv_bits is not None and plan is not None and plan.method == "palu":
        raise CheckpointError(
            f'{os.path.join(directory, "kvjax.json")}: "{SERVING}" asks for kv_bits {kv_bits}, but quantized pages '
            "are not supported on Palu models yet: set it to null"
        )
    try:
        module = nnx.eval_shape(lambda: Transformer(cfg, plan=plan, dtype=saved_dtype, rngs=nnx.Rngs(0)))
    except (TypeError, ValueError, IndexError) as e:
        if plan is None:
            raise
        raise CheckpointError(f"{plan_file}: does not fit the config in kvjax.json: {one_line(e)}") from None
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(nnx.state(module, nnx.Param))
    )
    if fmt == 1:  # restore the rotations in format 1's shape, then pack them
        _map_rotations(abstract, module.layouts, _format1_abstract)
    checkpointer = ocp.StandardCheckpointer()
    saved = _orbax_metadata(checkpointer, params_dir)
    _check_params(params_dir, _flat(saved), _flat(abstract), plan_may_be_missing=parts is None and plan is None)
    return _Checked(cfg, saved_dtype, fmt, kv_bits, plan, module, abstract, checkpointer, params_dir)


def load_saved(directory: str, dtype, *, shapes_only: bool = False):
    """(module, tokenizer, plan, kv_bits) of a checkpoint written by ``save``, cast to ``dtype`` (a name, or "auto":
    ``kvjax.machine.param_dtype``); ``kv_bits`` is the quantized pages it asks to be served from (None: the cache's
    dtype). A missing, corrupt or inconsistent part, or a NaN/inf parameter, is a ``CheckpointError`` naming it.
    ``shapes_only``: every part checked but no weight read, the module (joined) of shapes in ``dtype``: a
    tensor-parallel engine reads its devices' shares (``restore_sharded``)."""
    from kvjax.models.rotation import packed_rotation
    from kvjax.models.transformer import Transformer

    directory = os.path.abspath(directory)
    c = _checked(directory, sharded=shapes_only)
    dtype = jnp.dtype(machine.param_dtype(dtype, c.cfg.param_count()))  # "auto" by the model's size
    tokenizer = os.path.join(directory, "tokenizer")
    if shapes_only:

        def joined():
            module = Transformer(c.cfg, plan=c.plan, dtype=dtype, rngs=nnx.Rngs(0))
            module.join()
            return module

        return nnx.eval_shape(joined), _read_tokenizer(tokenizer), c.plan, c.kv_bits
    restored = _restore(c.checkpointer, c.params_dir, c.abstract)
    _check_values(c.params_dir, restored, dtype)
    module = c.module
    if c.fmt == 1:
        _map_rotations(restored, module.layouts, lambda layout, old: packed_rotation(old, layout.k_widths))
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, dtype), restored))
    nnx.update(module, state)
    return module, _read_tokenizer(tokenizer), c.plan, c.kv_bits


def restore_sharded(directory: str, dtype, devices) -> dict[tuple, jax.Array]:
    """Every parameter of the checkpoint at ``directory`` by path (``separate_params``' names), in ``dtype``, each
    spread over ``devices`` along its first axis they divide (replicated where none does, as norms are): every
    device reads from disk only its share of each large parameter, and the model is never whole on one device. A
    tensor-parallel split then moves each device's heads where they belong (``parallel.forward.shard``). The checks
    are ``load_saved``'s."""
    from flax.traverse_util import flatten_dict
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    c = _checked(os.path.abspath(directory), sharded=True)
    mesh, n = Mesh(list(devices), ("shards",)), len(devices)

    def spread(x):
        axes = [i for i, size in enumerate(x.shape) if size % n == 0]
        spec = [None] * x.ndim
        if axes:
            spec[axes[0]] = "shards"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    restored = _restore(c.checkpointer, c.params_dir, jax.tree.map(spread, c.abstract))
    _check_values(c.params_dir, restored, jnp.dtype(dtype), per_shard=True)
    return {path: x.astype(dtype) for path, x in flatten_dict(restored).items()}


def _map_rotations(params: dict, layouts, fn) -> None:
    """Replace each ZACK layer's ``qk_rotation`` leaf in ``params`` (a pure dict) by ``fn(layout, leaf)``."""
    for i, layout in enumerate(layouts):
        attn = params["layers"][i]["attn"]
        if "qk_rotation" in attn:
            attn["qk_rotation"] = fn(layout, attn["qk_rotation"])


def _format1_abstract(layout, leaf) -> jax.ShapeDtypeStruct:
    """Format 1's rotation: per group, zero-padded to the widest group, [Hkv, d, W]."""
    return jax.ShapeDtypeStruct((layout.num_kv_heads, layout.head_dim, max(layout.k_widths)), leaf.dtype)


def _read_meta(directory: str):
    """(config, saved dtype, parts or None, format, kv_bits or None) from ``kvjax.json``, every part it lists
    present."""
    from kvjax.models.config import ModelConfig

    meta_file = os.path.join(directory, "kvjax.json")
    meta = read_json(meta_file)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file}: expected a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT:
        raise CheckpointError(f"{meta_file} has format {fmt}; this kvjax reads format <= {FORMAT}: upgrade kvjax")
    if fmt not in (1, FORMAT):
        raise CheckpointError(f"{meta_file}: unknown kvjax checkpoint format {fmt!r}")
    parts = meta.get("parts")
    if parts is not None and not (isinstance(parts, list) and all(isinstance(p, str) for p in parts)):
        raise CheckpointError(f"{meta_file}: 'parts' must be a list of names, got {parts!r}")
    for part in dict.fromkeys([*(parts or []), "params"]):
        if not os.path.exists(os.path.join(directory, part)):
            raise CheckpointError(f"kvjax checkpoint {directory} is missing its {part}")
    if not isinstance(meta.get("config"), dict) or not isinstance(meta.get("dtype"), str):
        raise CheckpointError(f"{meta_file}: needs a config object and a dtype name")
    if "digest" in meta and meta["digest"] != config_digest(meta):  # checkpoints saved before it have none
        raise CheckpointError(
            f"{meta_file}: its config or dtype was edited after saving (they no longer match the digest saved with "
            'them), so they may not describe these weights: undo the edit, or delete "digest" to load it as edited'
        )
    kv_bits = _read_kv_bits(meta_file, meta.get(SERVING))
    try:
        return ModelConfig.from_dict(meta["config"]), jnp.dtype(meta["dtype"]), parts, meta["format"], kv_bits
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_file}: bad config or dtype: {one_line(e)}") from None


def _read_kv_bits(meta_file: str, serving) -> int | str | None:
    """The "kv_bits" of kvjax.json's "serving" object (absent: None); a bad value is a ``CheckpointError``. Other
    keys of "serving" are left to the kvjax that wrote them."""
    from kvjax.ops.kv_schemes import SERVED, served

    if serving is None:
        return None
    if not isinstance(serving, dict):
        raise CheckpointError(f'{meta_file}: "{SERVING}" must be an object, got {json.dumps(serving)[:80]}')
    kv_bits = serving.get("kv_bits")
    if kv_bits is None:
        return None
    try:
        return served(kv_bits)
    except ValueError:
        raise CheckpointError(
            f'{meta_file}: "{SERVING}": "kv_bits" must be {SERVED}, or null (unquantized pages), '
            f"got {json.dumps(kv_bits)[:80]}"
        ) from None


def _read_plan(plan_file: str):
    """The ``RankPlan`` in ``plan_file``, or None when there is none (an uncompressed model)."""
    from kvjax.compression.plan import RankPlan

    if not os.path.isfile(plan_file):
        return None
    with open(plan_file) as f:
        text = f.read()
    try:
        return RankPlan.from_json(text)
    except json.JSONDecodeError as e:
        raise json_error(plan_file, e) from None
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{plan_file}: not a valid rank plan: {one_line(e)}") from None


def _orbax_metadata(checkpointer, params_dir: str):
    """The saved parameter tree's metadata; a checkpoint missing its index files is a ``CheckpointError``."""
    ocdbt = os.path.isdir(os.path.join(params_dir, "ocdbt.process_0"))
    for name in ("_METADATA", "manifest.ocdbt") if ocdbt else ("_METADATA",):
        if not os.path.isfile(os.path.join(params_dir, name)):
            raise CheckpointError(f"{params_dir}: corrupt orbax checkpoint: it is missing its {name}")
    try:
        saved = checkpointer.metadata(params_dir).item_metadata
    except Exception as e:
        raise CheckpointError(f"{params_dir}: unreadable orbax metadata: {one_line(e)}") from None
    if saved is None:
        raise CheckpointError(f"{params_dir}: corrupt orbax checkpoint: its metadata cannot be read")
    return saved


def _check_values(params_dir: str, restored, dtype, per_shard: bool = False) -> None:
    """Every restored parameter is finite and fits ``dtype``. ``per_shard``: each device checks its own shards of a
    spread parameter, so no collective runs (one over four CPU devices, while orbax's threads were still at work,
    once found a device's thread missing)."""

    def flags(x):  # (finite, fits) of each part, on its device; fetched once for every parameter below
        parts = [s.data for s in x.addressable_shards if s.replica_id == 0] if per_shard else [x]
        return tuple(jnp.stack([jnp.isfinite(p).all(), jnp.isfinite(p.astype(dtype)).all()]) for p in parts)

    checks = jax.device_get(jax.tree.map(flags, restored))
    both = jax.tree.map(lambda f: np.all(np.stack(f), axis=0), checks, is_leaf=lambda f: isinstance(f, tuple))
    for name, (finite, fits) in _flat(both).items():
        if not finite:
            raise CheckpointError(f"{params_dir}: parameter {name} holds NaN or infinite values")
        if not fits:
            raise CheckpointError(
                f"{params_dir}: parameter {name} has values beyond {dtype.name}'s range; load it as bfloat16 or float32"
            )


def _read_tokenizer(path: str):
    """The saved tokenizer, or None when the checkpoint has none."""
    if not os.path.isdir(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable tokenizer: {one_line(e)}") from None


def _flat(tree) -> dict:
    """``{"layers.0.attn.q.kernel": leaf, ...}`` of a nested parameter tree."""
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _check_params(params_dir: str, saved: dict, want: dict, plan_may_be_missing: bool) -> None:
    """The saved parameters are exactly those of the config (and plan), with the same shapes."""
    extra, absent = sorted(set(saved) - set(want)), sorted(set(want) - set(saved))
    hint = "; the checkpoint's plan.json may be missing" if plan_may_be_missing else ""
    if extra or absent:
        what = "; ".join(s for s in (extra and f"unexpected {some(extra)}", absent and f"missing {some(absent)}") if s)
        raise CheckpointError(f"{params_dir}: parameters do not match the config in kvjax.json ({what}){hint}")
    for name, leaf in want.items():
        shape = getattr(saved[name], "shape", None)
        if shape is not None and tuple(shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"{params_dir}: parameter {name} has shape {tuple(shape)}, the config in kvjax.json "
                f"needs {tuple(leaf.shape)}{hint}"
            )


def _restore_error(error: BaseException) -> str:
    """One line saying which parameter orbax could not read and why, from its chain of TensorStore errors."""
    chain = _chain(error)
    for err in chain:
        m = re.search(r'Error reading "([^"/]+)/[^"]*".*?"[^"]*": (.*)', str(err))
        if m:
            return f"corrupt or truncated orbax checkpoint: cannot read parameter {m[1]}: {one_line(m[2])}"
    return f"corrupt or truncated orbax checkpoint: {one_line(chain[-1])}"


def _restore(checkpointer, params_dir: str, abstract):
    """orbax's restore; a failure is one CheckpointError line, and the noise of the reads it abandoned is dropped."""
    try:
        with _orbax_noise(("_read_array_index_and_device_put",)):
            return checkpointer.restore(params_dir, abstract)
    except Exception as e:
        raise CheckpointError(f"{params_dir}: {_restore_error(e)}") from None


class _OrbaxThreadErrors(logging.Filter):
    """Drops the errors orbax's background threads log: copies of the error its call then raises."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


@contextlib.contextmanager
def _orbax_noise(coroutines: tuple[str, ...]):
    """Around an orbax call: when it fails, the error it raises is all that shows. The work it abandoned ends in
    TensorStore's threads (its coroutines named in ``coroutines`` closed unfinished, callbacks into its closed
    event loop) and its threads log the error again: that noise is dropped, and waited for before re-raising
    (``_end_abandoned``)."""
    previous, noise, quiet, absl = sys.unraisablehook, [], _OrbaxThreadErrors(), logging.getLogger("absl")

    def hook(unraisable):
        coro = getattr(getattr(unraisable.object, "cr_code", None), "co_name", "")
        closed_loop = unraisable.object is None and str(unraisable.exc_value) == "Event loop is closed"
        if coro in coroutines or closed_loop:
            noise.append(time.monotonic())
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    absl.addFilter(quiet)
    try:
        yield
    except BaseException:
        start = time.monotonic()
        while time.monotonic() - max([start, *noise]) < 0.3 and time.monotonic() - start < 5:  # the work ends
            gc.collect()
            time.sleep(0.05)
        _end_abandoned(coroutines)
        raise
    finally:
        sys.unraisablehook = previous
        absl.removeFilter(quiet)


def _end_abandoned(coroutines: tuple[str, ...]) -> None:
    """After a failed orbax call: close its coroutines of ``coroutines`` still suspended, and take the exceptions
    of its tasks whose event loops are closed. Left to the garbage collector or the interpreter's exit, both print
    tracebacks of the error the call raised."""
    for obj in gc.get_objects():
        if inspect.iscoroutine(obj) and obj.cr_code.co_name in coroutines:
            if obj.cr_frame is not None and not obj.cr_running:
                with contextlib.suppress(BaseException):
                    obj.close()
        elif isinstance(obj, asyncio.Task) and obj.done() and not obj.cancelled() and obj.get_loop().is_closed():
            if f"{os.sep}orbax{os.sep}" in getattr(getattr(obj.get_coro(), "cr_code", None), "co_filename", ""):
                obj.exception()
