"""memra: a local OpenAI-compatible inference daemon whose cache survives history rewrites."""

__version__ = "0.1.0"
