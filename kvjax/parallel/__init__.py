"""Tensor parallelism (issue 38): which device holds which KV heads (``placement``)."""
