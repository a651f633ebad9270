"""``grpc.health.v1.Health``: grpcio-health-checking's asyncio servicer plus ``List``.

Its ``Check`` and ``Watch`` are used as they are; ``List`` (newer in health.proto than that servicer) answers every
service the servicer has a status for, "" (the server as a whole) included, so it is never UNIMPLEMENTED with an
ERROR traceback. It reads the statuses ``Check`` reads (the base class's table, one source of truth); they are set
only by ``Server.set_serving``.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health ships no type stubs
    """Check / Watch from grpcio-health-checking; List over the same statuses."""

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        statuses: dict[str, int] = dict(self._server_status)  # the table Check answers from
        reply = health_pb2.HealthListResponse()
        for name in sorted(statuses):
            reply.statuses[name].status = statuses[name]
        return reply
