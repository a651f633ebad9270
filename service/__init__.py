"""loraplex server: one base LLM, many LoRA / Medusa adapters, one process, one batch."""

__version__ = "0.1.0"
