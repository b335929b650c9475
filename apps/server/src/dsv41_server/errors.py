"""The server's one error type, and its exit statuses."""

from __future__ import annotations

import enum

__all__ = ["ExitCode", "ServerError"]


class ServerError(Exception):
    """A condition that stops the server before it starts; its message is shown to the user as is."""


class ExitCode(enum.IntEnum):
    """What the server's exit status says (a second SIGTERM/SIGINT exits at once with 128 + the signal)."""

    #: Stopped on request (SIGTERM/SIGINT): requests in flight finished, or were ended after the grace period.
    STOPPED = 0
    #: The engine died while serving (or the HTTP server stopped on its own): a supervisor should restart it.
    ENGINE_DIED = 1
    #: Refused to start: bad flags or a failed preflight check (the message says which).
    REFUSED = 2
    #: Start-up failed after the preflight: the engine or the HTTP server could not start.
    START_FAILED = 3
