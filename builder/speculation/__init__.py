"""Speculative decoding at build time: the ReDrafter draft head (model and beam search, traced into the engine), the
prompts a head is distilled on, and the head shipped for the default model."""
