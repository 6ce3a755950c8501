"""Attention over the worker's paged KV cache."""
