"""crosstalk: catch cross-tenant data leaks in LLM responses."""

__version__ = "0.1.0"
