"""The application on top of the house: the ``kvswitch`` command, the demo, ``generate``.

Everything below may be imported from here; nothing below imports this package.
"""
