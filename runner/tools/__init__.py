"""Tools around an engine: `runner bench`, `eval` (perplexity), `info` and `profile`."""
