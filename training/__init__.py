"""Drafter training: sits above both the builder and the runner (it runs a built target engine to generate and
score its training data, and writes a head the builder folds into a speculative engine)."""
