"""Shared test support; test modules import these (tests never import each other), `tests/conftest.py` wraps the
server, model and store ones in fixtures. Nothing here starts work at import time.

- `servers`: the test settings (`TEST_SETTINGS`, `tiny_settings`), request builders, free ports, `in_flight`
- `wait`: `wait_until`, the one polling helper
- `paths`: `ROOT`, the checkout
- `tiny_models`: tiny random Llama folders written by transformers, loading them, greedy and logit comparisons
- `adapter_files`: PEFT adapters written by peft, their reference models and edits
- `gguf_files`, `quant_reference`: GGUF files and dequantized references of the compact weight kinds
- `safetensors_cases`: valid and malformed safetensors files
- `engines`: stepped in-process engines and requests; `stores`: CPU adapter stores
- `http_api`, `metrics`, `certs`, `deploy`, `fuzz`: the HTTP API, metrics and dashboard, TLS, deployment and fuzzing
  tests' pieces
"""
