"""Tensor parallelism (``--tensor-parallel-size``): the rank processes, their group, and the model's
shards (docs/worker.md, "Tensor parallelism")."""
