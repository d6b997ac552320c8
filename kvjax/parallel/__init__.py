"""Tensor parallelism (issue 38): which device holds which KV heads (``placement``) and each device's share of a
layer's weights (``shards``)."""
