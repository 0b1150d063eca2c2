"""kvbench: a KV-cache compression benchmark on one paged runtime."""

__version__ = "0.1.0"
