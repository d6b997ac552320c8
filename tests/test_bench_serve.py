"""bench/serve.py's workloads: the trace's own (every prompt its own tokens) and the shared-prefix trace of
``--documents`` (each prompt one of a few documents and a question of its own), Poisson arrivals, one seed one
workload, a seed a rate."""

from types import SimpleNamespace

from conftest import fresh_seed

from bench.serve import rate_workloads, workload  # noqa: E402


def test_a_shared_prefix_trace_draws_each_prompt_from_a_few_documents():
    seed = fresh_seed()
    work = workload("arxiv", 40, 2.0, 1000, seed, scale=0.01, documents=3, question=5)
    assert work == workload("arxiv", 40, 2.0, 1000, seed, scale=0.01, documents=3, question=5)
    sends = [t for t, _, _ in work]
    assert sends == sorted(sends) and sends[0] > 0
    heads = {tuple(p[:-5]) for _, p, _ in work}
    assert 1 < len(heads) <= 3, f"seed {seed}"
    assert all(0 <= x < 1000 for _, p, _ in work for x in p) and all(o >= 1 for _, _, o in work)
    own = workload("arxiv", 40, 2.0, 1000, seed, scale=0.01)
    assert len({tuple(p[:10]) for _, p, _ in own}) == 40  # the plain trace shares nothing
    assert [o for *_, o in own] == [o for *_, o in work]  # the same output lengths


def test_each_rate_draws_its_own_prompts_so_no_rate_hits_the_prefix_cache_through_another():
    seed = fresh_seed()
    args = SimpleNamespace(
        rates=[2.0, 2.0, 8.0],
        seed=seed,
        trace="arxiv",
        requests=20,
        vocab=1000,
        scale=0.01,
        documents=0,
        question=64,
        max_seconds=5.0,
    )
    runs = rate_workloads(args)
    assert [(r, s) for r, s, _ in runs] == [(2.0, seed), (2.0, seed + 1), (8.0, seed + 2)]
    heads = [{tuple(p[:8]) for _, p, _ in work} for _, _, work in runs]
    assert not heads[0] & heads[1] and not heads[1] & heads[2], f"seed {seed}"
    assert all(0 < len(work) and all(t <= 5.0 for t, _, _ in work) for _, _, work in runs)
    assert rate_workloads(args) == runs  # one seed, one sweep
