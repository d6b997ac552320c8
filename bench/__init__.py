"""kvjax's benchmarks, one module per concern, each run from the repository root as ``python -m bench.<module>``
(``--help`` says what it measures). Tables go to bench/results/<area>.md (indexed by bench/RESULTS.md) with the command,
device and date; history to bench/notes/."""
