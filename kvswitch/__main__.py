"""``python -m kvswitch``: the same as the ``kvswitch`` command."""

from kvswitch.app.cli import main

raise SystemExit(main())
