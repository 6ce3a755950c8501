"""Attention over the paged KV cache: the function transformers calls (``paged.py``) and the CUDA
decode kernel it uses (``triton_decode.py``)."""
