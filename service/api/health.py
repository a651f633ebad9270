"""``grpc.health.v1.Health``: grpcio-health-checking's asyncio servicer plus ``List``.

Its ``Check`` and ``Watch`` are used as they are; ``List`` (newer in health.proto than that servicer) answers every
service whose status was ever ``set``, "" (the server as a whole) included, so it is never UNIMPLEMENTED with an
ERROR traceback. Statuses are set only by ``Server.set_serving``.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health ships no type stubs
    """Check / Watch from grpcio-health-checking; List over the same statuses."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType] = {}

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        self.statuses[service] = status
        await super().set(service, status)

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        reply = health_pb2.HealthListResponse()
        for name in sorted(self.statuses):
            reply.statuses[name].status = self.statuses[name]
        return reply
