"""Attention over the paged KV cache: the pool's memory (``kv_pool.py``), the function transformers
calls (``paged.py``) and the CUDA decode kernel it uses (``triton_decode.py``, ``decode_kernel.py``)."""
