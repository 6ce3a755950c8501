"""Generated stubs of protos/sluice/v1/worker.proto (do not edit; run protos/generate.py)."""
