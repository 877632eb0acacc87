"""``python -m kvswitch``: the same as the ``kvswitch`` command."""

from kvswitch.cli import main

raise SystemExit(main())
