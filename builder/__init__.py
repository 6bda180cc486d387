"""Build stage: checkpoint -> traced phase graphs -> engine artifact."""

__version__ = "0.1.0"
