"""The Python client SDK for the kvswitch router."""
