"""The streaming plumbing: the stream pump, delta coalescing, SSE framing, client connections."""
