"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``."""
