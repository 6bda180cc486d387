"""Quantization chosen at build time beyond round-to-nearest: GPTQ on calibration text, and the int8 KV cache's
scales."""
