"""The model families' text formats: one file per format, named after it (vLLM's name), declaring its
markers, streaming parser, forced-call grammar and template probe (declaration.py)."""
