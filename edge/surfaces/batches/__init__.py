"""The OpenAI Batch API: ``/v1/batches`` and the runner that answers their lines."""
