"""Speculative decoding's proposers: draft trees (``tree``), the ``Drafter`` protocol (``base``) and the
server-wide drafters (``prompt_lookup``). A drafter proposes; the engine's runner verifies whatever tree it gets.
"""
