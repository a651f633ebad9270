"""Generated protobuf / gRPC modules of the loraplex.v1 API (``make proto``; do not edit)."""
