"""The OpenAI Files API (``/v1/files``), for the Batch API's input and output files."""
