"""The HTTP API surfaces, one package each, on one translator protocol and one answer path."""
