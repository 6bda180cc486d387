"""The engine core: requests as plain data, the scheduler (what runs each step), the executor (runs the phase graphs),
the KV cache and prefix cache it binds, and the step loop (engine.py) that ties them to sampling and speculation.
It imports runner.sampling and runner.speculative, never the layers above it (the Python API, serving, tools, CLI)."""
