"""bench/gaps.py: a stream's idle time charged to the kernel after each gap, copies left out."""

import numpy as np
import pytest

from bench import gaps  # noqa: E402


def test_each_gap_goes_to_the_kernel_after_it_and_copies_neither_end_nor_take_one():
    rng = np.random.default_rng()
    names = ["gemm_1", "fusion.12", "kvjax_paged_decode_3", "gemm_2"]
    lengths = rng.integers(1_000, 50_000, size=4)
    idle = rng.integers(0, 9_000, size=3)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1] + idle)])
    events = [(int(s), int(n), name) for s, n, name in zip(starts, lengths, names, strict=True)]
    # an input copy that overlaps the first gap, and a memset on its own: neither is a kernel of the step
    events += [(int(starts[0] + lengths[0]), int(idle[0]) + 7, "MemcpyH2D"), (int(starts[-1]) + 5, 3, "Memset 0")]
    out = gaps.stream_gaps(rng.permutation(np.array(events, dtype=object)).tolist())
    assert out == {
        "fusion": (float(idle[0]), 1),
        "kvjax_paged_decode": (float(idle[1]), 1),
        "gemm": (float(idle[2]), 1),  # gemm_1 starts the stream: no gap before it
    }


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "0"], "--steps must be positive"),
        (["--rates", "0.5,nan"], "--rates must be a finite number"),
        (["--rates", "1"], "--rates must be in [0, 1)"),
        (["--shape", "32by2048"], "--shape must be BxCTX"),
        (["--shape", "0x2048"], "--shape's batch must be positive"),
        (["--json", "/nonexistent-folder/gaps.json"], "is not a writable directory"),
    ],
)
def test_bad_arguments_are_usage_errors_before_any_model_is_built(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        gaps.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
