"""What every adapter kind shares and nothing kind-specific: file checks (``files``), ids (``ids``) and the part
protocol (``part``). Modules here import no adapter kind, so each kind and the catalog import them without a cycle.
"""
