"""OpenAI's Responses API over the chat request path (see routes.py). No torch."""
