"""Developer tools run from a checkout (not installed): they may import both services."""
