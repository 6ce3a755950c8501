"""Attention over the paged KV cache: the function transformers calls, and its kernels."""
