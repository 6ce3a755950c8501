"""Tool-call and reasoning formats of the open-model families, one module per format family."""
