"""The server's one error type."""

from __future__ import annotations

__all__ = ["ServerError"]


class ServerError(Exception):
    """A condition that stops the server before it starts; its message is shown to the user as is."""
