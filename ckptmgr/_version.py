"""The ckptmgr version (one place, read by pyproject-independent code)."""

__version__ = "0.1.0"
