"""Reference and offline code that tests, scripts and benchmarks import, and the server never does.

Not installed with the server (``pyproject.toml`` packages ``service*`` only): it is used from a source checkout,
where the repository root is on ``sys.path`` (pytest's ``pythonpath``, the scripts' own path setup).
"""
