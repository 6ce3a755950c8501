"""Sluice worker: a gRPC service that streams generations from one model."""
