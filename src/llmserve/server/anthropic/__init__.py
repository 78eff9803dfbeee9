"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the
server's chat completion path: request translation, responses, the event stream, routes."""
