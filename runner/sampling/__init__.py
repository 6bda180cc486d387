"""Sampling: per-request parameters, structured-output grammars, banned words and log-probabilities. The lowest layer
of the runner: it imports no other runner package."""
