"""OpenAI legacy completions: ``POST /v1/completions``."""
