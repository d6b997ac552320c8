"""Tensor parallelism (issue 38): which device holds which KV heads (``placement``), each device's share of a
layer's weights (``shards``), and the sharded forward over a mesh (``forward``)."""
