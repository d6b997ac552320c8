"""A real ``kvjax-serve`` process on loopback, stressed by the official ``openai`` client with its retries off (so a
dropped connection is an error here, not a silent second try): 200 requests from four clients at once, /v1/models
and completions (token-id prompts, streamed or not: the fixture checkpoint has no tokenizer), with idle pauses
clustered just below, at and just above both keep-alive boundaries, the client pool's expiry and the server's
``--keep-alive``, among many zero pauses.

The server keeps an idle connection longer than the client pools it (as kvjax's defaults do: 75 s against httpx's
5 s), scaled down to 2 s against 1 s or 0.5 s: a client never reuses a connection the server is closing, so no
request may fail. (A pool kept longer than the server's keep-alive does fail at the boundary: a request sent as the
server closes the connection gets "Server disconnected without sending a response".)"""

import concurrent.futures
import random
import signal
import subprocess
import time

import pytest
from conftest import fresh_seed

# The server's extras and the client side, as in test_serving (whose import skips this file without FastAPI or
# uvicorn); httpx2 is the openai client's own HTTP library, whose pool expiry the clients here set.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

from test_serving import start_serve  # noqa: E402

NAME = "llama"
KEEP_ALIVE_S = 2  # the server's --keep-alive
CLIENT_EXPIRY_S = (1.0, 1.0, 0.5, 0.5)  # each client's pool keepalive_expiry, shorter than the server's keep-alive
REQUESTS_PER_CLIENT = 50
NEAR = (-0.05, -0.01, 0.0, 0.01, 0.05)  # pauses around a boundary


@pytest.fixture(scope="module")
def kvjax_serve():
    """``kvjax-serve`` on the fixture Llama with a short keep-alive; yields its base URL. Stopped by SIGTERM at
    the end, which must exit 0."""
    args = ["--max-seq-len", "128", "--max-batch", "4", "--dtype", "float32", "--keep-alive", str(KEEP_ALIVE_S)]
    proc, base = start_serve(*args, "--grace", "5", stdout=subprocess.DEVNULL)
    try:
        yield base, proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _pauses(rng: random.Random, expiry: float) -> list[float]:
    """One client's pause before each request: each boundary's near pauses twice, the rest zero, shuffled."""
    near = [max(0.0, b + d) for b in (expiry, KEEP_ALIVE_S) for d in NEAR] * 2
    pauses = near + [0.0] * (REQUESTS_PER_CLIENT - len(near))
    rng.shuffle(pauses)
    return pauses


def _chain(e: BaseException) -> str:
    parts = []
    while e is not None and len(parts) < 4:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def _client_run(base: str, expiry: float, seed: int, worker: int) -> list[str]:
    """One openai client's requests (retries off, its pool's expiry ``expiry``); the failures, described."""
    rng = random.Random(seed * 10 + worker)
    http = httpx2.Client(limits=httpx2.Limits(keepalive_expiry=expiry), timeout=60)
    client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, http_client=http)
    failures = []
    with http:
        for i, pause in enumerate(_pauses(rng, expiry)):
            time.sleep(pause)
            kind = rng.choice(["models", "complete", "complete", "stream"])
            max_tokens = rng.randint(1, 4)
            prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 12))]
            start = time.monotonic()
            try:
                if kind == "models":
                    assert [m.id for m in client.models.list().data] == [NAME]
                elif kind == "complete":
                    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
                    assert 1 <= out.usage.completion_tokens <= max_tokens, out
                    assert out.choices[0].finish_reason in ("stop", "length")
                else:
                    chunks = list(
                        client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True)
                    )
                    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
            except Exception as e:  # noqa: BLE001 - every failure is reported with where it happened
                failures.append(
                    f"client {worker} (pool expiry {expiry} s) request {i} ({kind}) after a {pause:.2f} s pause, "
                    f"failed after {time.monotonic() - start:.2f} s: {_chain(e)}"
                )
    return failures


def test_200_openai_requests_around_the_keep_alive_boundaries_all_get_answers(kvjax_serve):
    base, proc = kvjax_serve
    seed = fresh_seed()
    with concurrent.futures.ThreadPoolExecutor(len(CLIENT_EXPIRY_S)) as pool:
        runs = [pool.submit(_client_run, base, e, seed, w) for w, e in enumerate(CLIENT_EXPIRY_S)]
        failures = [f for run in runs for f in run.result()]
    assert proc.poll() is None, "kvjax-serve died"
    total = REQUESTS_PER_CLIENT * len(CLIENT_EXPIRY_S)
    assert not failures, f"{len(failures)} of {total} requests failed (seed {seed}):\n" + "\n".join(failures)
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0
