"""The OpenAI-compatible HTTP server: request/response schemas and the ASGI app."""
