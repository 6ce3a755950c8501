"""What the surfaces share: model bases, validation, the chat request, ids, finish names, usage, errors."""
