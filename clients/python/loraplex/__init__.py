"""Python client for the loraplex gRPC API."""
