"""``python -m dsv41_server``: the server's command line (see ``dsv41_server.cli``)."""

from dsv41_server.cli import main

raise SystemExit(main())
