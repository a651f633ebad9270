"""Weight loading: safetensors headers, checkpoint folders, and the streamed reader.

One reader serves both users: the base model (every tensor, once, at start) and the adapters (a few
tensors at a time, lazily). ``CheckpointIndex.open`` reads headers only; ``load_tensors`` fills caller-owned
destination tensors (any dtype, any device, views of fused parameters included) after validating the plan.
"""

from __future__ import annotations

from service.loading.header import DTYPES, MAX_HEADER_BYTES, TensorRecord, read_safetensors_header
from service.loading.index import CheckpointIndex
from service.loading.loader import LoadMode, LoadStats, check_plan, load_tensors

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "CheckpointIndex",
    "LoadMode",
    "LoadStats",
    "TensorRecord",
    "check_plan",
    "load_tensors",
    "read_safetensors_header",
]
