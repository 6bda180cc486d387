"""The OpenAI-compatible HTTP server: an app factory, the request/response protocol, the Responses API and tool calls.
It runs the engine core through runner.core.async_engine."""

# A chat that fills a 128k-token context is about 0.5 MiB of text: 8 MiB leaves room for long tool lists and
# documents, and refuses the bodies that would cost the server seconds of parsing (here, so that the command line
# reads it without importing the server).
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
