"""What the surfaces share: the sampling fields, the chat request and its rewrites, ids, finish names,
usage (the bases, validation and error bodies are below the surfaces, in :mod:`edge.requests`)."""
