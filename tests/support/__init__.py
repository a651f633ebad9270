"""Shared test support: live servers and their settings, engines, adapter stores, tiny models and files, certs, metrics.

Test modules import these (tests never import each other); `tests/conftest.py` wraps the server ones in fixtures.
Nothing here starts work at import time.
"""
