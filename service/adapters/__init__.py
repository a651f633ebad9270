"""Adapters: what a registered adapter id has (its parts), one package per part kind, and the catalog over them.

- ``common/``: what every kind shares: file checks and the path policy (``files``), ids (``ids``), the part
  protocols (``part``). It imports no kind, so the kinds and the catalog import it without a cycle.
- ``lora/``: PEFT LoRA weights: registration, the byte-budgeted tiered store, the batched math.
- ``medusa/``: Medusa heads: the format, the heads on a device, their registry and their drafter.
- ``catalog``, ``handle``: one view over every kind, and the per-request ``Adapter`` with one claim per part.
- ``kinds``: the registration table, one line per kind.
"""
