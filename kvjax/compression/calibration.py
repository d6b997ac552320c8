"""Calibration: run the uncompressed model over calibration tokens and accumulate per-head Gram matrices.

For every layer and KV head ``g`` we keep ``X^T X`` (``d_h x d_h``, float64 on the host) rather than the rows, so
memory does not grow with the number of tokens: ``q`` (post-RoPE rows of every query head of the group), ``q_pre``
(the same rows before RoPE), ``k`` (post-RoPE), ``k_pre`` (pre-RoPE k, the Palu baseline's basis) and ``v``.
``CalibrationStats.basis`` turns them into the directions each method keeps, ordered by singular value; the pre-RoPE
q and k Grams give ZACK's post-RoPE basis for positions calibration never reached (``positions.post_rope_gram``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from kvjax import validate
from kvjax.compression.once import jit_once
from kvjax.compression.positions import post_rope_gram
from kvjax.models.rope import apply_rope
from kvjax.ops.prefill.reference import causal_attention

KINDS = ("q", "q_pre", "k", "k_pre", "v")


@dataclasses.dataclass
class CalibrationStats:
    grams: dict[str, np.ndarray]  # kind -> float64 [L, Hkv, d, d]
    num_tokens: int

    def basis(self, kind: str, model, max_context: int | None = None) -> Basis:
        """The directions a method truncates, by descending singular value.

        ``qk`` (ZACK's shared Q/K rotation): eigenvectors of the q and k Grams, each normalised by its trace so
        that neither the G query heads nor the one key head dominates the shared rotation. Orthogonal:
        ``up = down^T``. With ``max_context``, the q and k Grams are those of positions ``0..max_context-1``
        derived from the pre-RoPE ones (``post_rope_gram``) rather than those of the positions calibration saw.
        ``qk-pair`` (ZACK with a score-aware pair): from the same trace-normalised q and k Grams (and
        ``max_context``), their square roots ``Cq``, ``Ck`` and the SVD ``Cq Ck = X S Y^T``: queries are projected
        on ``A = Cq^-1 X S^1/2`` (``up = A^T``) and keys on ``B = Ck^-1 Y S^1/2`` (``down``). ``A B^T = I``, so
        keeping every direction changes no score; keeping the first ``k`` minimises the expected squared score
        error ``E[(q k^T - q A_k B_k^T k^T)^2]`` for q and k drawn independently from their Grams (Eckart-Young on
        ``Cq Ck``), where one orthogonal basis for both minimises their energies' error. Not orthogonal.
        ``k_pre``: eigenvectors of the pre-RoPE k Gram (Palu). Orthogonal.
        ``v``: output-aware. Truncating V's directions costs ``||V (I - P) W_o||``, so the basis comes from
        ``C V^T V C`` with ``C = (sum_j W_o^(j) W_o^(j)^T)^(1/2)`` over the group's query heads ``j``:
        ``down = C Z``, ``up = Z^T C^-1`` (``down @ up = I``): the error that reaches the attention output is
        what the truncation minimises, not V's own (bench/notes/2026-11-accuracy.md, "Basis choices").
        """
        g = self.grams
        if max_context is not None and kind not in ("qk", "qk-pair"):
            raise ValueError(f"max_context applies to the 'qk' basis only, not {kind!r}")
        if kind in ("qk", "qk-pair"):

            def trace(x):
                return np.trace(x, axis1=-2, axis2=-1)[..., None, None]

            q, k = g["q"], g["k"]
            if max_context is not None:
                if "q_pre" not in g:
                    raise ValueError("these statistics have no pre-RoPE query Gram ('q_pre'); recalibrate")
                q, k = (
                    np.stack(
                        [post_rope_gram(layer, model.module.inv_freq(i), max_context) for i, layer in enumerate(g[pre])]
                    )
                    for pre in ("q_pre", "k_pre")
                )
            if kind == "qk-pair":
                return score_pair(q / trace(q), k / trace(k))
            down, s = principal_axes(q / trace(q) + k / trace(k))
            return Basis(down, np.swapaxes(down, -1, -2), s)
        if kind == "k_pre":
            down, s = principal_axes(g["k_pre"])
            return Basis(down, np.swapaxes(down, -1, -2), s)
        if kind == "v":
            c, c_inv = _sqrtm(_wo_grams(model))
            z, s = principal_axes(c @ g["v"] @ c)
            return Basis(c @ z, np.swapaxes(z, -1, -2) @ c_inv, s)
        raise ValueError(f"unknown basis kind {kind!r}")


@dataclasses.dataclass
class Basis:
    """Per layer and KV head: ``down`` [L, Hkv, d, d] (columns = kept directions first), ``up`` (its inverse,
    rows), ``s`` [L, Hkv, d] singular values. Keeping ``k`` directions maps x -> x @ down[:, :k] -> @ up[:k]."""

    down: np.ndarray
    up: np.ndarray
    s: np.ndarray


def principal_axes(gram):
    """Eigenvectors by descending eigenvalue, each column's sign fixed (largest entry positive), and sqrt(eig)."""
    lam, vecs = np.linalg.eigh(gram)
    lam, vecs = lam[..., ::-1], vecs[..., ::-1]
    idx = np.argmax(np.abs(vecs), axis=-2)[..., None, :]
    vecs = vecs * np.sign(np.take_along_axis(vecs, idx, axis=-2))
    return np.ascontiguousarray(vecs), np.sqrt(np.maximum(lam, 0.0))


PAIR_FLOOR = 1e-9  # the Grams' eigenvalues floored at this share of the largest before ``score_pair`` inverts them


def score_pair(q_gram, k_gram) -> Basis:
    """The score-aware Q/K pair of ``CalibrationStats.basis("qk-pair")`` from q and k Grams [..., d, d]: keys on
    ``down`` (``B``), queries on ``up``'s rows (``A^T``), ``s`` the singular values of ``Cq Ck``, descending.
    Eigenvalues are floored (``PAIR_FLOOR``) in both square roots alike, so ``A B^T = I`` still holds exactly in
    exact arithmetic; the directions a floor touches carry almost no score and are the last kept."""
    cq, cq_inv = _sqrtm(q_gram, PAIR_FLOOR)
    ck, ck_inv = _sqrtm(k_gram, PAIR_FLOOR)
    x, s, yt = np.linalg.svd(cq @ ck)  # Cq is symmetric: Cq^T Ck = Cq Ck
    root = np.sqrt(s)[..., None, :]
    a = cq_inv @ x * root
    b = ck_inv @ np.swapaxes(yt, -1, -2) * root
    return Basis(np.ascontiguousarray(b), np.ascontiguousarray(np.swapaxes(a, -1, -2)), s)


def _sqrtm(gram, floor=1e-6):
    """Symmetric square root of a PSD matrix and its inverse (eigenvalues floored relative to the largest)."""
    lam, u = np.linalg.eigh(gram)
    lam = np.maximum(lam, floor * lam[..., -1:])
    ut = np.swapaxes(u, -1, -2)
    return u @ (np.sqrt(lam)[..., None] * ut), u @ ((1 / np.sqrt(lam))[..., None] * ut)


def _wo_grams(model) -> np.ndarray:
    """Per layer and KV head, ``sum_j W_o^(j) W_o^(j)^T`` over the group's query heads [L, Hkv, d, d] (float64)."""
    cfg = model.config
    return np.stack(
        [
            np.asarray(_wo_gram(block.attn.o.kernel[...], cfg.num_kv_heads, cfg.head_dim), np.float64)
            for block in model.module.layers
        ]
    )


@jit_once(static_argnums=(1, 2))
def _wo_gram(wo, num_kv_heads: int, head_dim: int):
    """One layer's W_o Grams on the device, in float32 at full precision (W_o stays where it is)."""
    w = wo.astype(jnp.float32).reshape(num_kv_heads, -1, head_dim, wo.shape[-1])
    return jnp.einsum("gjde,gjfe->gdf", w, w, precision="highest")


def _batch_grams(model, tokens, valid) -> dict:
    """Gram matrices [L, Hkv, d, d] (float32) of one batch of calibration sequences, layer by layer: layers of one
    layout share one compiled function (they differ only in their weights and RoPE frequencies), so calibration
    compiles a layer per layout, not the whole model."""
    module = model.module
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = module.embed_tokens(tokens)
    grams = []
    for i, (block, layout) in enumerate(zip(module.layers, module.layouts)):
        graphdef, state = nnx.split(block)
        x, g = _layer_grams(graphdef, state, x, positions, valid, module.inv_freq(i), layout)
        grams.append(g)
    return {kind: jnp.stack([g[kind] for g in grams]) for kind in KINDS}


@jit_once(static_argnums=(0, 6))
def _layer_grams(graphdef, state, x, positions, valid, inv_freq, layout):
    """One layer's output and its Grams (q, q_pre, k, k_pre, v: [Hkv, d, d]) over the valid rows of ``x``."""
    block = nnx.merge(graphdef, state)
    b, t, _ = x.shape
    hkv, d = layout.num_kv_heads, layout.head_dim
    w = valid.astype(jnp.float32)[:, :, None, None, None]
    grams = {}

    def gram(rows):  # rows [B, T, Hkv, n, d] -> [Hkv, d, d]
        rows = rows.astype(jnp.float32) * w
        return jnp.einsum("btgnd,btgne->gde", rows, rows, precision="highest")

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rebuild is not None or rotation is not None:
            raise ValueError("calibration runs on an uncompressed model")
        kh = k.reshape(b, t, hkv, 1, d)
        grams["q"] = gram(q.reshape(b, t, hkv, -1, d))
        grams["q_pre"] = gram(apply_rope(q.reshape(b, t, -1, d), -positions, inv_freq).reshape(b, t, hkv, -1, d))
        grams["k"] = gram(kh)
        grams["k_pre"] = gram(apply_rope(kh[:, :, :, 0], -positions, inv_freq)[:, :, :, None])
        grams["v"] = gram(v.reshape(b, t, hkv, 1, d))
        return causal_attention(q, k, v, layout)

    return block(x, positions, inv_freq, layout, attend, 0), grams


def calibrate(model, tokens: np.ndarray, *, batch_size: int = 4, snapshots=(), progress: bool = True):
    """Accumulate Gram matrices over ``tokens`` [num_sequences, seq_len] (row-major; a trailing -1 pads).

    Returns the final ``CalibrationStats``; with ``snapshots`` (token counts), returns a dict count -> stats taken
    once that many tokens had been seen (used by the rotation-stability table).
    """
    if model.plan is not None:
        raise ValueError("calibrate an uncompressed model")
    tokens = np.asarray(tokens)
    totals: dict[str, np.ndarray] = {}
    seen, taken = 0, {}
    with tqdm(total=int((tokens >= 0).sum()), desc="calibrating", unit="tok", disable=not progress) as bar:
        for start in range(0, len(tokens), batch_size):
            chunk = tokens[start : start + batch_size]
            if len(chunk) < batch_size:  # keep one compiled shape
                chunk = np.concatenate([chunk, np.full((batch_size - len(chunk), tokens.shape[1]), -1)])
            valid = chunk >= 0
            out = _batch_grams(model, jnp.asarray(np.maximum(chunk, 0), jnp.int32), jnp.asarray(valid))
            out = {kind: np.asarray(g, np.float64) for kind, g in out.items()}
            totals = {kind: totals[kind] + out[kind] for kind in KINDS} if totals else out
            seen += int(valid.sum())
            bar.update(int(valid.sum()))
            for count in snapshots:
                if count not in taken and seen >= count:
                    taken[count] = CalibrationStats({k: v.copy() for k, v in totals.items()}, seen)
    return taken if snapshots else CalibrationStats(totals, seen)


# Named text sources -> the domains (``text.domain_text``) whose calibration parts they draw on, row by row in turn.
TEXT_SOURCES = {"text": ("prose", "code"), "prose": ("prose",), "code": ("code",)}


def calibration_tokens(model, source="text", num_tokens: int = 16384, seq_len: int = 512, seed: int = 0):
    """Token ids [num_sequences, seq_len] (int64; trailing -1 pads the last row) from ``source``.

    ``source``: "text" (rows alternate prose and code: row 0 the first ``seq_len`` tokens of "prose", row 1 those of
    "code", row 2 the next prose ones, ...), "prose" (the calibration half of Python's pydoc topics), "code" (the
    calibration part of the standard library's code: ``text.stdlib_code``), "text:PATH" (a UTF-8 file), "random"
    (uniform ids from ``seed``), or a sequence of token ids. Text needs the model's tokenizer (``check_source``).
    """
    num_tokens, seq_len = validate.positive("num_tokens", num_tokens), validate.positive("seq_len", seq_len)
    vocab = model.config.vocab_size
    if isinstance(source, str) and source == "random":
        streams = {"random": np.random.default_rng(seed).integers(0, vocab, num_tokens)}
    elif isinstance(source, str):
        streams = _text_ids(model, source)
    else:
        if isinstance(source, np.ndarray):
            source = source.reshape(-1)
        streams = {"tokens": validate.token_ids("calibration tokens", source, vocab)}
    rows = -(-num_tokens // seq_len)
    lengths = [min(seq_len, num_tokens - r * seq_len) for r in range(rows)]  # valid tokens of each row
    names = list(streams)
    owner = [names[r % len(names)] for r in range(rows)]  # the stream each row comes from, in turn
    for name, ids in streams.items():
        need = sum(n for n, o in zip(lengths, owner) if o == name)
        if len(ids) < need:
            what = name if len(names) == 1 else f"{source!r}: its {name} domain"
            raise ValueError(f"calibration {what} has {len(ids)} tokens, fewer than the {need} asked for")
    out = np.full((rows, seq_len), -1, np.int64)
    taken = dict.fromkeys(names, 0)
    for r, (n, name) in enumerate(zip(lengths, owner)):
        out[r, :n] = np.asarray(streams[name][taken[name] : taken[name] + n])
        taken[name] += n
    return out


def check_source(model, source) -> None:
    """Refuse a calibration source that cannot work, before any work: an unknown name, text (any source but
    "random" and token ids) for a model without a tokenizer, or a "text:PATH" that is missing or not a file."""
    from kvjax.compression.text import check_text_file

    if not isinstance(source, str) or source == "random":
        return
    if source not in TEXT_SOURCES and not source.startswith("text:"):
        raise ValueError(
            f"calibration must be 'random', 'text', 'prose', 'code', 'text:PATH' or token ids, got {source!r}"
        )
    if model.tokenizer is None:
        raise ValueError(
            f"calibration {source!r} is text, but this model has no tokenizer: pass calibration='random' "
            "(random token ids) or token ids"
        )
    if source.startswith("text:"):
        check_text_file(source[len("text:") :])


def _text_ids(model, source: str) -> dict[str, np.ndarray]:
    """The token ids of text ``source``, per domain ({"prose": ..., "code": ...} for "text"; one entry for the
    others), in the order rows take them."""
    from kvjax.compression.text import domain_text, read_text_file

    check_source(model, source)
    if source.startswith("text:"):
        texts = {source: read_text_file(source[len("text:") :])}
    else:
        texts = {domain: domain_text(domain, "calibration") for domain in TEXT_SOURCES[source]}
    return {
        name: np.asarray(
            validate.token_ids(
                f"calibration text {name!r}",
                model.tokenizer(text, add_special_tokens=False)["input_ids"],
                model.config.vocab_size,
            )
        )
        for name, text in texts.items()
    }
