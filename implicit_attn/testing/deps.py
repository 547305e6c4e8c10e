"""The test extras ``implicit_attn.testing`` needs (torch, transformers, hypothesis): imported
on demand with an error that says how to install them. They are never runtime dependencies
of the library."""
from __future__ import annotations

import importlib

INSTALL = "pip install implicit-attn[test]"


def require(name: str):
    """Import and return module ``name``; ``ImportError`` naming the test extra if missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"implicit_attn.testing needs {name!r} (a test extra, not a runtime dependency of "
                          f"implicit_attn): {INSTALL}") from e


__all__ = ["require", "INSTALL"]
