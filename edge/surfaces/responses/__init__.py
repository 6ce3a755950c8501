"""The OpenAI Responses API: ``POST /v1/responses`` (stateless)."""
