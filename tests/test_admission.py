"""Admission that protects the other clients: a prompt too long to fit is refused before it is tokenized,
tokenizing runs beside the event loop (so /health answers while a long prompt is encoded), and routes that do not
exist answer with OpenAI's error body."""

import concurrent.futures
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_serving import NAME, served  # noqa: E402, F401 - the module's server fixture

from kvjax.serving.api import TEXT_MARGIN, longest_token  # noqa: E402


def health_latencies(base: str, busy: concurrent.futures.Future) -> list[float]:
    """/health's answer times, polled while ``busy`` runs (at least once)."""
    times = []
    with httpx.Client(timeout=30) as http:
        while not busy.done() or not times:
            start = time.perf_counter()
            assert http.get(base + "/health").status_code == 200
            times.append(time.perf_counter() - start)
            time.sleep(0.05)
    return times


def test_a_10mb_prompt_is_refused_untokenized_while_health_answers(served):  # noqa: F811
    model, _, base, _ = served
    huge = "lorem ipsum " * (10_000_000 // 12)
    limit = TEXT_MARGIN * longest_token(model.tokenizer) * 128
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for path, body in (
            ("/v1/completions", {"model": NAME, "prompt": huge, "max_tokens": 4}),
            ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": huge}], "stream": True}),
        ):
            start = time.perf_counter()
            sent = pool.submit(httpx.post, base + path, json=body, timeout=60)
            latencies = health_latencies(base, sent)
            r = sent.result()
            assert r.status_code == 400, r.text[:200]
            message = r.json()["error"]["message"]
            assert (
                f"hold{'s' if 'prompt' in body else ''} {len(huge):,} characters" in message
                and "refused before tokenizing" in message
            )
            assert max(latencies) < 1.0 and time.perf_counter() - start < 10, (latencies, path)
            assert len(huge) > limit


def test_a_slow_tokenization_does_not_stall_the_event_loop(served, monkeypatch):  # noqa: F811
    """Tokenizing is off the loop: while one prompt takes 2 s to encode, /health answers in well under a second."""
    _, _, base, worker = served
    from kvjax.serving.api import Server

    original = Server.encode

    def slow(self, prompt, messages=None):
        time.sleep(2.0)
        return original(self, prompt, messages)

    monkeypatch.setattr(Server, "encode", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            httpx.post, base + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        latencies = health_latencies(base, sent)
        assert sent.result().status_code == 200
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies


@pytest.mark.parametrize(
    "method, path, status, kind",
    [
        ("GET", "/v1/nothing", 404, "not_found_error"),
        ("GET", "/v1/completions", 405, "invalid_request_error"),
        ("DELETE", "/health", 405, "invalid_request_error"),
    ],
)
def test_unknown_routes_and_methods_answer_with_openais_error_body(served, method, path, status, kind):  # noqa: F811
    _, _, base, _ = served
    r = httpx.request(method, base + path)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["type"] == kind and path in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_a_cache_smaller_than_max_seq_len_sets_the_limit_and_an_engine_failure_says_why(monkeypatch):
    """A cache of 4 pages of 16 under max_seq_len 128 (given as num_pages, which start-up does not refuse): the
    server's limit is the 64 positions the cache holds, so a longer request is a 400 with the numbers, streamed or
    not. One that the engine still finishes with an error (the limit lifted here) is a 500 with the engine's message,
    or, streamed, its abort chunk, an error event with the message, then [DONE] (before: a lone abort chunk)."""
    import json

    from conftest import TINY_CONFIGS, tiny_tokenizer
    from test_serving import running

    import kvjax
    from kvjax.runtime.engine import Engine

    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=5)
    model.tokenizer = tiny_tokenizer(model.config.vocab_size)
    with running(model, Engine(model, max_batch=2, max_seq_len=128, num_pages=5)) as (app, base):
        body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 100}
        for stream in (False, True):
            r = httpx.post(base + "/v1/completions", json={**body, "stream": stream}, timeout=60)
            assert r.status_code == 400 and "it needs 103 positions, more than the 64" in r.text, r.text
        monkeypatch.setattr(app.state.server, "capacity", 128)
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "more than the 64 one sequence can hold" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={**body, "stream": True}, timeout=60)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last, error = json.loads(events[-3]), json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort"
        assert "more than the 64 one sequence can hold" in error["error"]["message"]
