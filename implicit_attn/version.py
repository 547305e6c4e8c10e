"""The library version (its own module so that any layer can record it)."""
__version__ = "0.1.0"
