"""kvjax-serve on loopback, driven by the official ``openai`` client: answers equal ``kvjax.generate``'s single-run
greedy ones, streamed or not, 64 at once; a client that leaves frees its pages; bad input gets a 400 and disturbs
nothing; SIGTERM lets requests in flight finish and exits cleanly."""

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import socket
import string
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS, tiny_tokenizer

# The server's extras (pip install kvjax[serve], and the client side of [test]): a machine without them, the GPU
# one say, skips this file instead of failing to collect it.
fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import kvjax  # noqa: E402
from kvjax.runtime.engine import Engine  # noqa: E402
from kvjax.runtime.text import encode_prompt  # noqa: E402
from kvjax.serving.api import create_app, server_config  # noqa: E402
from kvjax.serving.worker import Worker  # noqa: E402

NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*args: str, env=None, stdout=subprocess.PIPE, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``kvjax-serve`` on the fixture Llama checkpoint (token-id prompts: it has no tokenizer) with ``args``, on a
    free port: (the process, its URL) once /health answers. The caller stops it."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvjax.cli.serve", "--model", os.path.join(FIXTURES, "llama"), "--port", str(port)]
    proc = subprocess.Popen([*cmd, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"kvjax-serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("kvjax-serve did not start")
        time.sleep(0.2)


@contextlib.contextmanager
def running(model, engine: Engine):
    """``model`` on ``engine`` behind the real HTTP stack on 127.0.0.1, in a thread: yields (the app, its URL)."""
    worker = Worker(engine).start()
    app = create_app(worker, model, NAME)
    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        worker.stop()


@pytest.fixture(scope="module")
def served():
    """A tiny random model behind the real HTTP stack on 127.0.0.1; a cache of 40 pages of 16 (fewer than 8
    sequences of 128 need), so a full batch of long requests preempts."""
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=3, scale=4.0)
    model.tokenizer = tiny_tokenizer(model.config.vocab_size)
    with running(model, Engine(model, max_batch=8, max_seq_len=128, chunk_tokens=32, num_pages=40)) as (app, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)
        yield model, client, base, app.state.server.worker


def reference(model, prompt, max_tokens, chat=False, stop=None):
    """``kvjax.generate``'s greedy text for ``prompt`` alone."""
    (r,) = kvjax.generate(model, [prompt], max_new_tokens=max_tokens, chat=chat, stop=stop, max_batch=1)
    return r


def settled_text(model, prompt: str, result, tol: float = 1e-3) -> tuple[str, bool]:
    """``result``'s text up to its first near-tie (top-2 logits within ``tol``: a batch's float order may pick either
    token there), and whether it has none; the logits come from one full forward over the prompt and its tokens."""
    ids = encode_prompt(model, prompt, chat=False)
    tokens = list(result.tokens)
    logits = np.asarray(model.logits(np.asarray([ids + tokens], np.int32))[0, len(ids) - 1 :])
    for j in range(len(tokens)):
        top2 = np.sort(logits[j])[-2:]
        if top2[1] - top2[0] < tol:
            return model.tokenizer.decode(tokens[:j], skip_special_tokens=True), False
    return result.text, True


def wait_idle(base: str, timeout: float = 20.0) -> dict:
    """/health once nothing runs and every page is free (or the last reading at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(base + "/health").json()
        if (health["running"] == 0 and health["free_pages"] == health["total_pages"]) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_models_and_health(served):
    _, client, base, _ = served
    assert [m.id for m in client.models.list().data] == [NAME]
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["total_pages"] == 39


def test_a_repeated_prompt_reads_cached_pages_and_health_counts_them(served):
    """Prefix caching on by default: the second of two equal prompts reads the first one's full pages (read-only)
    and gives the same text; /health counts the tokens read."""
    _, client, base, _ = served
    prompt = "a document many share, " * 3
    before = httpx.get(base + "/health").json()["prefix_hit_tokens"]
    outs = [client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0) for _ in range(2)]
    health = httpx.get(base + "/health").json()
    assert health["prefix_hit_tokens"] >= before + 16 and health["prefix_cached_pages"] > 0, health
    assert outs[0].choices[0].text == outs[1].choices[0].text


def test_completions_and_chat_streamed_or_not_equal_generate(served):
    model, client, _, _ = served
    want = reference(model, "the cat sat", 12)
    out = client.completions.create(model=NAME, prompt="the cat sat", max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
    assert out.usage.completion_tokens == len(want.tokens) and out.usage.prompt_tokens == want.prompt_tokens
    parts = client.completions.create(model=NAME, prompt="the cat sat", max_tokens=12, temperature=0, stream=True)
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    want = reference(model, "hi there", 10, chat=True)
    messages = [{"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == want.text and out.choices[0].message.role == "assistant"
    parts = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts) == want.text


def test_benchmark_extensions_stream_every_token_id_past_eos(served):
    """``return_token_ids`` puts each token batch's ids in its event (text or not); ``ignore_eos`` runs to
    max_tokens. The ids up to the first EOS are generate's tokens."""
    model, _, base, _ = served
    body = {"model": NAME, "prompt": [4, 5, 6], "max_tokens": 40, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "return_token_ids": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", base + "/v1/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    ids = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert len(ids) == 40 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(len(e["choices"][0]["token_ids"]) >= 1 for e in events[:-1])  # one event per step at least
    (want,) = kvjax.generate(model, [[4, 5, 6]], max_new_tokens=40, max_batch=1)
    assert ids[: len(want.tokens)] == want.tokens


def test_a_stop_string_ends_the_text_before_it(served):
    model, client, _, _ = served
    free = reference(model, "abc", 30).text
    stop = free[3:5] if len(free) >= 5 else None
    if not stop or not stop.strip():
        pytest.skip("the random model's text has no usable stop string here")
    want = reference(model, "abc", 30, stop=[stop])
    for stream in (False, True):
        out = client.completions.create(
            model=NAME, prompt="abc", max_tokens=30, temperature=0, stop=stop, stream=stream
        )
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == want.text and stop not in text


def test_64_concurrent_requests_each_get_their_single_run_tokens(served):
    model, client, base, worker = served
    rng = np.random.default_rng()
    alphabet = np.array(list(string.ascii_lowercase + " "))
    prompts = ["".join(rng.choice(alphabet, int(n))) for n in rng.integers(40, 80, 64)]
    lengths = [int(n) for n in rng.integers(40, 48, 64)]  # 8 running need more than the 39 pages: preemption
    want = [settled_text(model, p, reference(model, p, n)) for p, n in zip(prompts, lengths)]
    before = httpx.get(base + "/health").json()

    def ask(i):
        out = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(ask, range(64)))
    # Exact where the greedy path has no near-tie; past one, float order in a batch may take the other token.
    assert [g == w if exact else g.startswith(w) for g, (w, exact) in zip(got, want)] == [True] * 64
    assert sum(exact for _, exact in want) >= 56  # the check still covers (nearly) every request whole
    after = wait_idle(base)
    assert after["free_pages"] == 39 and after["preemptions"] > before["preemptions"]


def test_a_client_that_disconnects_mid_stream_frees_its_pages(served):
    _, _, base, worker = served
    body = {"model": NAME, "prompt": "a long one", "max_tokens": 110, "temperature": 0.8, "seed": 1, "stream": True}
    body["ignore_eos"] = True  # it runs until cancelled
    aborted = httpx.get(base + "/health").json()["aborted"]
    with httpx.Client(timeout=60) as http, http.stream("POST", base + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    health = wait_idle(base)
    assert health["running"] == 0 and health["free_pages"] == health["total_pages"]
    assert health["aborted"] == aborted + 1  # cancelled, not run to its end
    assert health["window_pages"] == {}  # the tiny Llama has no sliding-window layers


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": "other"}, "not served here"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"prompt": "x" * 200}, "more than the 128"),
        ({"max_tokens": 127, "prompt": "xy"}, "more than the 128"),
        ({"prompt": [1, 2, 500]}, "must be in [0, 97)"),
        ({"n": 2}, "n"),
        ({"stop": ""}, "stop strings must not be empty"),
        ({"stop": ["x", ""]}, "stop strings must not be empty"),
    ],
)
def test_a_bad_request_gets_a_400_and_disturbs_nothing(served, change, message):
    model, client, base, _ = served
    body = {"model": NAME, "prompt": "ok", "max_tokens": 4, **change}
    response = httpx.post(base + "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**body)
    want = reference(model, "ok", 4)
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=4, temperature=0).choices[0].text == want.text


def test_the_server_keeps_idle_connections_longer_than_clients_pool_them(served):
    """A client reuses a pooled connection for up to its keep-alive expiry; were the server's shorter or equal, a
    request could go out on a socket the server is closing and fail without reaching it."""
    _, client, _, _ = served
    pools = [httpx.Limits().keepalive_expiry, httpx.Client()._transport._pool._keepalive_expiry]
    pools.append(client._client._transport._pool._keepalive_expiry)  # the openai client's own pool
    config = server_config(fastapi.FastAPI(), "127.0.0.1", 0)
    assert all(e is not None and config.timeout_keep_alive > e for e in pools), (config.timeout_keep_alive, pools)


def test_malformed_json_and_bad_messages_get_a_400(served):
    _, _, base, _ = served
    bad = httpx.post(
        base + "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    bad = httpx.post(base + "/v1/chat/completions", json={"model": NAME, "messages": []})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    bad = httpx.post(
        base + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}
    )
    assert bad.status_code == 400


def test_sigterm_lets_a_request_in_flight_finish_and_exits_cleanly():
    """The command itself, on a fixture checkpoint (token-id prompts: it has no tokenizer)."""
    proc, base = start_serve("--max-seq-len", "256", "--max-batch", "2", "--dtype", "float32", "--grace", "20")
    try:
        body = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True}
        events = []
        with httpx.Client(timeout=120) as http, http.stream("POST", base + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and not events:
                    proc.send_signal(signal.SIGTERM)  # while the request runs
                events.append(line)
        done = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert [e for e in events if e][-1] == "data: [DONE]"
        assert done[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(timeout=60) == 0
        assert "KV cache:" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_capacity_line_counts_tokens_and_what_they_would_be_uncompressed():
    import dataclasses
    import re

    from kvjax.cli.serve import capacity_line

    cfg = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
    model = kvjax.Model.random(cfg, seed=1, scale=5.0)
    plain = capacity_line(Engine(model, max_batch=2, max_seq_len=64, num_pages=21), model)
    share = "; identical prefixes share pages (/health: prefix_hit_tokens)"
    assert plain == f"KV cache: 320 tokens uncompressed (20 pages of 16; num_pages=21{share})"
    windowed = kvjax.Model.random(dataclasses.replace(cfg, arch="mistral", sliding_window=5), seed=1)
    line = capacity_line(Engine(windowed, max_batch=2, max_seq_len=64, num_pages=21), windowed)
    assert line.endswith(
        "(20 pages of 16; layers with a 5-token window: 8 pages, given back as the window passes; num_pages=21)"
    )
    small = kvjax.compress(model, target_rate=0.5, calibration="random", num_tokens=128, seq_len=32, progress=False)
    line = capacity_line(Engine(small, max_batch=2, max_seq_len=64, num_pages=21), small)
    m = re.fullmatch(
        r"KV cache: 320 tokens at overall rate (\S+) \(zack rate (\S+)\), (\d+) uncompressed in the same memory "
        r"\(20 pages of 16; num_pages=21; identical prefixes share pages \(/health: prefix_hit_tokens\)\)",
        line,
    )
    assert m and float(m[1]) == float(m[2]) == round(small.plan.rate, 2), line
    assert abs(int(m[3]) - 320 * (1 - small.plan.rate)) <= 1
    # quantized pages: every byte a token takes counts (codes, scales, zeros, padding), on top of the plan's rate
    for compressed in (model, small):
        engine = Engine(compressed, max_batch=2, max_seq_len=64, num_pages=11, kv_bits=4)
        line = capacity_line(engine, compressed)
        m = re.search(r"at overall rate (\S+) \((.*)\), (\d+) uncompressed", line)
        ratio = sum(engine.token_bytes().values()) / (2 * 2 * 64 * 2 * 4)  # 2 layers, K and V, 2 heads of 64, f32
        assert m and float(m[1]) == round(1 - ratio, 2) and 0.6 < 1 - ratio < 0.95, line
        assert m[2].endswith("int4 pages") and ("zack" in m[2]) == (compressed is small), line
    evicting = Engine(model, max_batch=2, max_seq_len=64, num_pages=21, eviction="kvcompress:4x")
    assert capacity_line(evicting, model).endswith(
        "(20 per-head pages and 8 staging pages of 16; each prompt evicted to kvcompress:4x once prefilled; "
        "num_pages=21)"
    )


def test_an_evicting_server_answers_as_generate_does_and_gives_every_page_back():
    """An engine that evicts each prompt to a quarter (KV-Compress) behind the HTTP stack: long prompts, one at a
    time and then eight at once, get ``kvjax.generate``'s answers with the same eviction, and once idle every
    staging and per-head page is free again (/health)."""
    cfg = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
    model = kvjax.Model.random(cfg, seed=5, scale=4.0)
    model.tokenizer = tiny_tokenizer(model.config.vocab_size)
    engine = Engine(model, max_batch=4, max_seq_len=128, chunk_tokens=32, eviction="kvcompress:4x")
    prompts = [" ".join(string.ascii_lowercase[i : i + 9]) * 3 for i in range(8)]
    want = [kvjax.generate(model, [p], max_new_tokens=8, max_batch=1, eviction="kvcompress:4x")[0] for p in prompts]
    with running(model, engine) as (_, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)
        out = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=8, temperature=0)
        assert out.choices[0].text == want[0].text
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = pool.map(
                lambda p: client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0), prompts
            )
            for got, ref, prompt in zip(texts, want, prompts):
                assert got.choices[0].text == ref.text, prompt
        health = wait_idle(base)
        assert health["free_pages"] == health["total_pages"] and health["head_pages"][0] == health["head_pages"][1]
