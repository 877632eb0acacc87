"""Ways to run kvswitch as a fleet: ``local`` starts a router and workers as processes on this
machine (``kvswitch up``), each a ``processes.Child`` restarted when it dies."""
