"""Weight-only quantization for the worker: layers (layers.py), GGUF block repacking
(gguf_blocks.py) and tensor-by-tensor loading (loading.py). docs/quantization.md has the figures."""
