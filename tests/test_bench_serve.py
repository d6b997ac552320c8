"""bench/serve.py's workloads: the trace's own (every prompt its own tokens) and the shared-prefix trace of
``--documents`` (each prompt one of a few documents and a question of its own), Poisson arrivals, one seed one
workload."""

import sys
from pathlib import Path

from conftest import fresh_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from serve import workload  # noqa: E402


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
