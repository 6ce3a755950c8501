"""OpenAI embeddings (``POST /v1/embeddings``): request and response models, route."""
