"""The OpenAI-compatible HTTP server: an app factory, the request/response protocol, the Responses API and tool calls.
It runs the engine core through runner.core.async_engine."""
