"""OpenAI-compatible HTTP frontend of kvserve."""

__version__ = "0.1.0"
