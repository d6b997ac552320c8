"""Steps kept on disk traced and lowered (``jax.export``), so that a process meeting a step a process before it met
skips the work JAX's compilation cache cannot: tracing the step and lowering it, every Pallas kernel included, to
StableHLO (issue 39, item 1; bench/results/startup.md "Start-up: steps kept traced"). ``compile`` reads or stores a
step; ``trace_apart`` traces steps in other processes.

The store is ``steps/`` inside the compilation cache's directory (``compile_cache.use``), on and off with it. A step's
``key`` covers everything its trace depends on (kvjax's source, library versions, device kind, JAX's settings, the
caller's ``fingerprint``, the step's inputs). A file is written whole or not at all; one that cannot be read is traced
again. Files are unpickled, so the directory is the user's alone. ``KVJAX_STEP_CACHE_VERIFY=1`` traces every stored
step again and fails unless the module is the stored one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import pickle
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
from jax import export

VERSION = 2  # 2: modules named after their step (``_named``), not ``flat``
FOLDER = "steps"
VERIFY = "KVJAX_STEP_CACHE_VERIFY"
# Pallas's Triton kernels are custom calls; a stored step is only read back by the jaxlib that wrote it (the key)
_CHECKS = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def directory() -> Path | None:
    """Where steps are stored: ``steps/`` in JAX's compilation cache directory; None while that cache is off."""
    where = jax.config.jax_compilation_cache_dir
    if not where or not jax.config.jax_enable_compilation_cache:
        return None
    return Path(where) / FOLDER


@functools.cache
def _source() -> str:
    """A hash of kvjax's own source (every module a step's trace may run) and the libraries that trace it."""
    import flax
    import jaxlib

    h = hashlib.blake2b(digest_size=16)
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(f"{jax.__version__} {jaxlib.version.__version__} {flax.__version__}".encode())
    return h.hexdigest()


# JAX's settings that change what a trace gives (its whole ``trace_context`` grows as modules register theirs)
_SETTINGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_use_shardy_partitioner",
    "jax_pallas_use_mosaic_gpu",
)


def _settings() -> str:
    """JAX's settings that change a trace, and the devices."""
    values = [f"{name}={getattr(jax.config, name, None)}" for name in _SETTINGS]
    devices = jax.local_devices()
    return f"{' '.join(values)} {devices[0].platform} {devices[0].device_kind} x{len(devices)}"


def key(name: Sequence, fingerprint: bytes, args: tuple) -> str:
    """The key of step ``name`` of a caller ``fingerprint`` called on ``args``."""
    leaves, tree = jax.tree.flatten(args)
    h = hashlib.blake2b(digest_size=20)
    for part in (str(VERSION), _source(), _settings(), repr(tuple(name))):
        h.update(part.encode() + b"\0")
    h.update(fingerprint + b"\0" + pickle.dumps(tree))
    for leaf in leaves:
        h.update(f"{jax.typeof(leaf)} {getattr(leaf, 'sharding', None)}\0".encode())
    return h.hexdigest()


@dataclasses.dataclass
class Step:
    """A compiled step called as the jitted one was (its inputs' tree ``in_tree``, its outputs' ``out_tree``);
    ``stored``: whether its module came from the store (else it was traced, and stored)."""

    compiled: Callable
    in_tree: jax.tree_util.PyTreeDef
    out_tree: jax.tree_util.PyTreeDef
    stored: bool

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        if tree != self.in_tree:
            raise TypeError(f"a step compiled for inputs {self.in_tree} called with {tree}")
        return jax.tree.unflatten(self.out_tree, self.compiled(*leaves))


def compile(
    fn: Callable,
    args: tuple,
    *,
    name: Sequence,
    fingerprint: bytes,
    donate: int | None = None,
    compiler_options: dict | None = None,
    where: Path | None = None,
) -> Step:
    """``fn`` (not jitted) compiled for ``args``: its module read from the store under ``where`` (default
    ``directory()``) if there, else traced, lowered and stored. ``donate``: the argument whose buffers the step
    updates in place (``jax.jit``'s ``donate_argnums``). The executable is the same either way: both compile the
    stored module, so JAX's compilation cache finds the first process's executable in the next."""
    where = where or directory()
    leaves, in_tree = jax.tree.flatten(args)
    path = None if where is None else where / f"{key(name, fingerprint, args)}.step"
    found = _read(path)
    if found is None:
        out_tree, exported = _export(fn, in_tree, leaves)
        if path is not None:
            _write(path, out_tree, exported)
    else:
        out_tree, exported = found
        if os.environ.get(VERIFY) == "1" and _code(_export(fn, in_tree, leaves)[1]) != _code(exported):
            raise AssertionError(f"stored step {path} differs from its trace: its key misses what changed")
    donated: tuple[int, ...] = ()
    if donate is not None:
        before = sum(len(jax.tree.leaves(a)) for a in args[:donate])
        donated = tuple(range(before, before + len(jax.tree.leaves(args[donate]))))
    call = jax.jit(_named(exported.call, fn), donate_argnums=donated, compiler_options=compiler_options)
    return Step(call.lower(*leaves).compile(), in_tree, out_tree, stored=found is not None)


def trace_apart(jobs: Sequence[tuple], *, fingerprint: bytes, processes: int, where=None, progress=False) -> int:
    """Trace and store the ``jobs`` ((name, fn, args), as ``compile`` takes them) not stored yet, in a pool of
    ``processes`` fresh processes; returns how many it stored. Tracing and lowering hold Python's lock, so threads
    cannot overlap them; processes can. The processes run JAX on the CPU and lower for this process's platform
    (Pallas's Triton lowering told this GPU's compute capability), so they take no device memory. They are spawned,
    which re-imports the caller's main module: it must not run anything on import. A job whose process fails is left
    for ``compile`` to trace here."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    from tqdm import tqdm

    where = where or directory()
    if where is None or processes < 1:
        return 0
    todo: list[tuple[Path, bytes]] = []
    for name, fn, args in jobs:
        path = where / f"{key(name, fingerprint, args)}.step"
        if not path.is_file():
            leaves, in_tree = jax.tree.flatten(args)
            shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in map(jax.typeof, leaves)]
            todo.append((path, pickle.dumps((fn, in_tree, shapes))))
    if not todo:
        return 0
    platform = export.default_export_platform()
    setup = (platform, _compute_capability() if platform == "cuda" else None)
    stored = 0
    pool = ProcessPoolExecutor(min(processes, len(todo)), mp_context=get_context("spawn"))
    with pool, tqdm(total=len(todo), desc="tracing", unit="step", disable=not progress) as bar:
        futures = {pool.submit(_trace_one, job, *setup): path for path, job in todo}
        for future in as_completed(futures):
            bar.update()
            try:
                out_tree, exported = pickle.loads(future.result())
            except Exception:  # noqa: S112  # this step is traced here instead
                continue
            stored += _write(futures[future], out_tree, exported)
    return stored


def _compute_capability() -> int:
    """This GPU's compute capability as Pallas's Triton lowering reads it (90 for sm_90: an integer, not the
    device's "9.0"), for processes without the GPU to lower the same kernels."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    return int(registration.gpu_info_lib.get_gpu_info().compute_capability)


def _trace_one(job: bytes, platform: str, capability: int | None) -> bytes:
    """In a process of ``trace_apart``: one step traced and lowered for ``platform``, serialized."""
    from kvjax.ops.lowering import as_if_on_gpu

    jax.config.update("jax_platforms", "cpu")
    fn, in_tree, shapes = pickle.loads(job)
    with as_if_on_gpu(capability) if capability is not None else contextlib.nullcontext():
        out_tree, exported = _export(fn, in_tree, shapes, platforms=(platform,))
    return pickle.dumps((out_tree, exported.serialize()))


def _code(exported: export.Exported) -> str:
    """A stored module's text without debug locations (which name whoever called the trace: a process of
    ``trace_apart``, or the caller's own script), each Pallas Triton kernel's serialized IR replaced by its text
    (its bytes also depend on what the process lowered before it)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    def walk(op):
        yield op
        for region in op.regions:
            for block in region:
                for inner in block:
                    yield from walk(inner.operation)

    with mlir.make_ir_context() as context:
        module = ir.Module.parse(exported.mlir_module())
        kernels = []
        for op in walk(module.operation):
            if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
                config = op.attributes["mhlo.backend_config"]
                if isinstance(config, ir.DictAttr) and "ir" in config:
                    kernels.append(_triton_text(context, ir.StringAttr(config["ir"]).value_bytes))
        text = str(module.operation.get_asm(enable_debug_info=False))
    return "\n".join([re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir = <kernel>", text), *kernels])


def _triton_text(context, data: bytes) -> str:
    """A Triton kernel's serialized IR as text, without debug locations."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect

    dialect.register_dialect(context)
    return str(ir.Module.parse(data, context).operation.get_asm(enable_debug_info=False))


def _export(fn, in_tree, leaves, platforms=None) -> tuple[jax.tree_util.PyTreeDef, export.Exported]:
    """``fn`` traced and lowered over flat inputs and outputs (so the store holds no kvjax types), and its outputs'
    tree."""
    trees = []

    def flat(*xs):
        out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, xs)))
        trees.append(tree)
        return out

    exported = export.export(jax.jit(_named(flat, fn)), platforms=platforms, disabled_checks=_CHECKS)(*leaves)
    return trees[0], exported


def _named(run: Callable, step: Callable) -> Callable:
    """``run`` under ``step``'s name (through ``functools.partial``s): JAX names a jitted function's trace, lowering
    and compile events (``jax.monitoring``) and its module after it, so that a stored step's compile is counted as
    its step's (``bench.engine.compile_times``), not as ``flat``'s or ``call``'s."""
    while isinstance(step, functools.partial):
        step = step.func
    name = getattr(step, "__name__", "step")

    def named(*xs):
        return run(*xs)

    named.__name__ = named.__qualname__ = name
    return named


def _read(path: Path | None) -> tuple[jax.tree_util.PyTreeDef, export.Exported] | None:
    """A stored step, or None where there is none or it cannot be read (it is then traced and written again)."""
    if path is None or not path.is_file():
        return None
    try:
        stored = pickle.loads(path.read_bytes())
        if stored.get("version") != VERSION:
            return None
        return stored["out_tree"], export.deserialize(stored["exported"])
    except Exception:  # a file cut short, or written by another version: the step is traced again
        return None


def _write(path: Path, out_tree, exported: export.Exported | bytes | bytearray) -> bool:
    """Store a step whole or not at all: written beside, then renamed in. A store that cannot be written (a full
    disk, a read-only directory) costs the next process a trace, not this one its step; False then."""
    data = bytes(exported) if isinstance(exported, (bytes, bytearray)) else exported.serialize()
    data = pickle.dumps(dict(version=VERSION, out_tree=out_tree, exported=data))
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True
