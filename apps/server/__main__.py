"""``uv run apps/server [FLAGS]``: uv runs this file; the server lives in the ``dsv41_server`` package."""

from dsv41_server.cli import main

raise SystemExit(main())
