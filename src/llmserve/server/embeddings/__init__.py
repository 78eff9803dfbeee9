"""``POST /v1/embeddings``: OpenAI's embeddings API over prefill-only engine requests."""
