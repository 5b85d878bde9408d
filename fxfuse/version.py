"""fxfuse's version (one place: the package, the cache key and the packaging metadata read it)."""
__version__ = "0.1.0"
