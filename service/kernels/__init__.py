"""Compiled kernels for the hot path, chosen at run time for this CPU (``native``); the eager torch paths otherwise."""
