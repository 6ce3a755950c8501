"""Reranking (``/rerank``, ``/v1/rerank``, ``/v2/rerank``: Jina's and Cohere's shape as vLLM serves it)
and pair scores (``/v1/score``): request and response models, routes; both one ``Score`` call."""
