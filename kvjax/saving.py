"""Saving and loading kvjax checkpoints: ``kvjax.json`` (config), ``plan.json`` (rank plan, if compressed),
``params/`` (an orbax checkpoint of the Flax parameters) and ``tokenizer/``. Written atomically: everything goes
into a temporary sibling directory that is renamed into place only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

FORMAT = 1


def save(model, directory: str, *, overwrite: bool = False) -> str:
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    if os.path.exists(directory) and not overwrite:
        raise FileExistsError(f"{directory} already exists (pass overwrite=True to replace it)")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {directory}: {parent} is not a writable directory")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, "kvjax.json"), "w") as f:
            json.dump({"format": FORMAT, "config": model.config.to_dict(), "dtype": str(model.dtype)}, f, indent=1)
        if model.plan is not None:
            with open(os.path.join(tmp, "plan.json"), "w") as f:
                f.write(model.plan.to_json())
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(tmp, "params"), nnx.to_pure_dict(nnx.state(model.module, nnx.Param)))
        checkpointer.wait_until_finished()
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def is_kvjax_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "kvjax.json"))


def load_saved(directory: str, dtype):
    import orbax.checkpoint as ocp

    from kvjax.compression.plan import RankPlan
    from kvjax.model import Model
    from kvjax.models.config import ModelConfig
    from kvjax.models.transformer import Transformer

    directory = os.path.abspath(directory)
    with open(os.path.join(directory, "kvjax.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory}: unknown kvjax checkpoint format {meta.get('format')!r}")
    cfg = ModelConfig.from_dict(meta["config"])
    plan = None
    if os.path.isfile(os.path.join(directory, "plan.json")):
        with open(os.path.join(directory, "plan.json")) as f:
            plan = RankPlan.from_json(f.read())
    saved_dtype = jnp.dtype(meta["dtype"])
    module = nnx.eval_shape(lambda: Transformer(cfg, plan=plan, dtype=saved_dtype, rngs=nnx.Rngs(0)))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    restored = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), abstract)
    restored = jax.tree.map(lambda x: jnp.asarray(x, dtype), restored)
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(module, state)
    tokenizer = None
    if os.path.isdir(os.path.join(directory, "tokenizer")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(directory, "tokenizer"))
    return Model(module, tokenizer, plan)
