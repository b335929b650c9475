"""The one exception type the pack tools raise for bad input."""

from __future__ import annotations

__all__ = ["PackError"]


class PackError(Exception):
    """Bad input or a failed check; the message names the file (and the tensor or field) at fault."""
