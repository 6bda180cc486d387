"""The host side of speculative decoding that is pure bookkeeping: draft beams -> a token tree to verify, prompt-lookup
drafts, acceptance statistics. The separate draft model runs on the core's executor, so it lives in runner.core."""
