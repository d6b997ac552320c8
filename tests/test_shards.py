"""Each device's share of a layer under tensor parallelism (``kvjax.parallel.shards``): for the byte-balanced
placement on 1, 2, 4 and 8 devices (8: each KV head replicated on two), the devices' partial attention outputs (their
heads' columns of q, K and V, their local layout, their rows of o) sum to the layer's, on a plain and on a
ZACK-compressed model (float32; one rotation, or a score-aware pair), and ZACK's rotation sliced by a device's K
columns rotates that device's queries and keys as the whole rotation does."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from kvjax.layout import HeadLayout
from kvjax.models.rotation import QKRotation
from kvjax.models.transformer import separate_params
from kvjax.ops.prefill.reference import causal_attention
from kvjax.parallel.placement import layout_bytes, place
from kvjax.parallel.shards import columns, even_split, local_layout

FOUR = dataclasses.replace(TINY_CONFIGS["llama"], num_heads=8, num_kv_heads=4, head_dim=32, hidden_size=128)


def captured(model, tokens):
    """Per layer, what attention is handed: (q, k, v, rotation) as ``Transformer.hidden`` calls ``attend``."""
    seen = []

    def attend(i, q, k, v, rebuild=None, rotation=None):
        seen.append((q, k, v, rotation))
        return causal_attention(*(rotation.packed(q, k) if rotation is not None else (q, k)), v, model.layouts[i])

    model.module.hidden(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), attend)
    return seen


@pytest.fixture(scope="module")
def models():
    seed = fresh_seed()
    plain = kvjax.Model.random(FOUR, seed=seed % 1000, scale=2.0)
    calibration = dict(seed=seed % 1000, calibration="random", num_tokens=256, seq_len=64)
    zack = kvjax.compress(plain, removal_rate=0.5, **calibration)
    pair = kvjax.compress(plain, removal_rate=0.5, qk_basis="pair", **calibration)
    return seed, {"plain": plain, "zack": zack, "zack pair": pair}


@pytest.mark.parametrize("which", ["plain", "zack", "zack pair"])
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_the_devices_partial_attention_outputs_sum_to_the_layers(models, which, devices):
    """On 8 devices each of the 4 KV heads is held by two, each with one of its two query heads."""
    seed, found = models
    model = found[which]
    tokens = np.random.default_rng(seed).integers(0, FOUR.vocab_size, (2, 24))
    params = separate_params(model.module)
    placement = place(layout_bytes(list(model.layouts)), devices)
    for i, (q, k, v, rotation) in enumerate(captured(model, tokens)):
        layout = model.layouts[i]
        wo = params["layers", i, "attn", "o", "kernel"].astype(jnp.float32)
        qp, kp = rotation.packed(q, k) if rotation is not None else (q, k)
        want = causal_attention(qp, kp, v, layout) @ wo
        got = jnp.zeros_like(want)
        for d in range(devices):
            heads, replica = placement.heads[i, d], (d % placement.replicas, placement.replicas)
            local = local_layout(layout, heads, placement.replicas)
            if rotation is not None:  # the device rotates its own full-width heads with its columns of the rotation
                cols = columns(layout, heads, "k")
                query = None if rotation.query is None else rotation.query[:, cols]
                mine = QKRotation(rotation.matrix[:, cols], local, query)
                ql = q[..., columns(layout, heads, "q_full", *replica)]
                ql, kl = mine.packed(ql, k[..., columns(layout, heads, "k_full")])
                np.testing.assert_allclose(ql, qp[..., columns(layout, heads, "q", *replica)], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(kl, kp[..., columns(layout, heads, "k")], rtol=1e-5, atol=1e-5)
            else:
                ql, kl = q[..., columns(layout, heads, "q", *replica)], k[..., columns(layout, heads, "k")]
            out = causal_attention(ql, kl, v[..., columns(layout, heads, "v")], local)
            got = got + out @ wo[columns(layout, heads, "o", *replica)]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4, err_msg=f"seed {seed}, layer {i}, {devices}")


def test_the_mlp_and_vocabulary_split_evenly_and_sum_back():
    """gate/up by columns and down by rows, each device one shape: the partial outputs sum to the MLP's; the
    vocabulary padded to a multiple of the devices, its padded rows zeros."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    e, f = 16, 97
    x, gate, up, down = (rng.normal(size=s) for s in ((3, e), (e, f), (e, f), (f, e)))
    want = (x @ gate) * (x @ up) @ down
    for devices in (1, 2, 4):
        per, padded = even_split(f, devices)
        assert padded >= f and padded - f < devices and per * devices == padded
        pad = ((0, 0), (0, padded - f))
        g, u, dn = np.pad(gate, pad), np.pad(up, pad), np.pad(down, pad[::-1])
        shares = [slice(d * per, (d + 1) * per) for d in range(devices)]
        got = sum((x @ g[:, s]) * (x @ u[:, s]) @ dn[s] for s in shares)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"seed {seed}")


def test_columns_refuse_what_is_not_a_set_of_heads():
    layout = HeadLayout(8, 4, 32, (16, 32, 16, 32), (32, 16, 32, 16))
    assert columns(layout, [2], "k").tolist() == list(range(48, 64))
    assert columns(layout, [1, 0], "o").tolist() == [*range(64, 96), *range(0, 64)]
    assert local_layout(layout, [3, 1]) == HeadLayout(4, 2, 32, (32, 32), (16, 16))
    assert columns(layout, [1], "o", 1, 2).tolist() == list(range(80, 96))  # head 1's second query head
    assert local_layout(layout, [1], 2) == HeadLayout(1, 1, 32, (32,), (16,))
    with pytest.raises(ValueError, match="cannot be split among 3 replicas"):
        local_layout(layout, [1], 3)
    for bad in ([], [4], [1, 1], [-1]):
        with pytest.raises(ValueError, match="heads must be distinct KV heads"):
            columns(layout, bad, "q")
    with pytest.raises(ValueError, match="part must be one of"):
        columns(layout, [0], "w")
    with pytest.raises(ValueError, match="must be positive"):
        even_split(10, 0)


def test_one_padded_local_layout_holds_every_devices_heads():
    """Local head j is as wide as the widest j-th head of any device; ``into`` puts a narrower head's columns at the
    start of its wider block (q and o: each query head's block at the start of its own)."""
    from kvjax.parallel.shards import into, padded_widths

    layout = HeadLayout(8, 4, 64, (64, 16, 32, 48), (16, 64, 48, 32))
    k, v = padded_widths(layout, [[0, 1], [3, 2]])
    assert (k, v) == ((64, 32), (32, 64))
    local = HeadLayout(4, 2, 64, k, v)
    src, dst = into(layout, [3, 2], local, "k")  # head 3 (48) into slot 0 (64), head 2 (32) into slot 1 (32)
    assert src.tolist() == [*range(112, 160), *range(80, 112)] and dst.tolist() == [*range(0, 48), *range(64, 96)]
    src, dst = into(layout, [3, 2], local, "o")  # G=2 query heads of V width 32 into slots of 32, then 48 into 64
    assert dst.tolist() == [*range(0, 32), *range(32, 64), *range(64, 112), *range(128, 176)]
    assert src.tolist() == columns(layout, [3, 2], "o").tolist()
    with pytest.raises(ValueError, match="the same number of KV heads"):
        padded_widths(layout, [[0], [1, 2]])
