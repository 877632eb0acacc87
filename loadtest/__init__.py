"""Load on a fleet: request traces (``trace.py``), the trace-driven fleet simulator (``sim.py``,
``kvswitch sim``) and load tests against a live router (``live.py``, ``kvswitch loadtest``)."""
