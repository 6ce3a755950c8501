"""Sluice: shared pieces of the edge and the worker (the gRPC contract, the launcher)."""
