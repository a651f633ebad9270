"""The `loraplex.v1.Adapters` servicer: register, remove and inspect adapters (thin; the store does the work, and
loading and removal go through the seam both edges share, ``service.frontend.adapters``).

Every method taking an id checks it first (``service.adapters.common.ids``): a malformed id is INVALID_ARGUMENT,
NOT_FOUND is for a well-formed id that is not registered. Methods raise typed errors; the interceptors
(``service.api.interceptors``) turn them into statuses and count them.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp
from loraplex.v1 import adapters_pb2 as pb
from loraplex.v1 import adapters_pb2_grpc as pb_grpc

from service.adapters.catalog import AdapterCatalog
from service.adapters.common.ids import check_adapter_id
from service.adapters.lora import AdapterInfo
from service.adapters.lora.part import LoraPart
from service.adapters.medusa.part import MedusaPart
from service.api.runtime import Runtime
from service.api.status import Context
from service.frontend.adapters import AdapterAdmin

_STATES = {
    "registered": pb.ADAPTER_STATE_REGISTERED,
    "loading": pb.ADAPTER_STATE_LOADING,
    "host": pb.ADAPTER_STATE_HOST,
    "device": pb.ADAPTER_STATE_DEVICE,
    "failed": pb.ADAPTER_STATE_FAILED,
}


def _tier(device_bytes: int, host_bytes: int) -> pb.AdapterTier.ValueType:
    """The fastest tier holding a copy: the device, else host memory, else the weights file alone."""
    if device_bytes:
        return pb.ADAPTER_TIER_DEVICE
    return pb.ADAPTER_TIER_HOST if host_bytes else pb.ADAPTER_TIER_DISK


def _stamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def describe(catalog: AdapterCatalog, adapter_id: str) -> pb.AdapterInfo:
    """One adapter as the API shows it: its LoRA part's store state, plus its Medusa heads if it has any."""
    catalog.resolve(adapter_id)  # AdapterNotFound
    lora, medusa = catalog.kind(LoraPart), catalog.kind(MedusaPart)
    info = lora.store.get(adapter_id) if lora is not None and lora.has(adapter_id) else None
    heads = 0
    if medusa is not None and medusa.has(adapter_id):
        heads = medusa.registry.spec(adapter_id).num_heads
        if info is None:
            return _medusa_only(catalog, medusa, adapter_id)
    assert info is not None
    message = info_to_pb(info, medusa_heads=heads)
    message.source = catalog.source_of(adapter_id) or message.source
    return message


def _medusa_only(catalog: AdapterCatalog, medusa: MedusaPart, adapter_id: str) -> pb.AdapterInfo:
    spec = medusa.registry.spec(adapter_id)
    usage = medusa.usage(adapter_id)
    return pb.AdapterInfo(
        id=adapter_id,
        source=catalog.source_of(adapter_id) or str(spec.source),
        resolved_path=str(spec.source),
        kind=pb.ADAPTER_KIND_MEDUSA,
        medusa_heads=spec.num_heads,
        state=pb.ADAPTER_STATE_DEVICE if usage.resident else pb.ADAPTER_STATE_REGISTERED,
        tier=_tier(usage.device_bytes, 0),
        total_bytes=spec.raw_nbytes(),
        device_bytes=usage.device_bytes,
        load_latency=pb.LoadLatency(index_seconds=spec.index_seconds),
    )


def info_to_pb(info: AdapterInfo, *, medusa_heads: int = 0) -> pb.AdapterInfo:
    resident = len(info.layers)
    message = pb.AdapterInfo(
        id=info.id,
        source=str(info.source),
        resolved_path=str(info.source),
        kind=pb.ADAPTER_KIND_MEDUSA_LORA if medusa_heads else pb.ADAPTER_KIND_LORA,
        rank=info.rank,
        alpha=info.alpha,
        target_modules=sorted(info.target_modules),
        medusa_heads=medusa_heads,
        state=_STATES[info.state],
        host_bytes=info.host_bytes,
        device_bytes=info.device_bytes,
        num_layers=resident,
        host_layers=resident if info.host_bytes else 0,
        device_layers=resident if info.device_bytes else 0,
        hits=info.hits,
        load_latency=pb.LoadLatency(
            index_seconds=info.index_seconds,
            read_seconds=info.read_seconds,
            layout_seconds=info.layout_seconds,
            total_seconds=info.total_seconds,
        ),
        active_requests=info.pins,
        pinned=info.pins > 0,
        error=info.error or "",
        loads=info.loads,
        disk_reads=info.disk_reads,
        evictions=info.evictions,
        tier=_tier(info.device_bytes, info.host_bytes),
        dora=info.dora,
        saved_modules=list(info.saved_modules),
    )
    if (last := _stamp(info.last_used)) is not None:
        message.last_used.CopyFrom(last)
    if (registered := _stamp(info.registered_at)) is not None:
        message.registered_at.CopyFrom(registered)
    return message


def unloaded(info: pb.AdapterInfo) -> pb.AdapterInfo:
    """``info`` of an adapter just removed: state UNLOADED, nothing resident any more."""
    gone = pb.AdapterInfo()
    gone.CopyFrom(info)
    gone.state = pb.ADAPTER_STATE_UNLOADED
    gone.host_bytes = gone.device_bytes = gone.host_layers = gone.device_layers = 0
    gone.tier = pb.ADAPTER_TIER_DISK
    return gone


class AdaptersServicer(pb_grpc.AdaptersServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.admin = AdapterAdmin(runtime)  # the checks and order shared with the HTTP edge

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: Context) -> pb.LoadAdapterResponse:
        store = await self.admin.load(request.id, request.source)
        return pb.LoadAdapterResponse(adapter=describe(store, request.id))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: Context) -> pb.UnloadAdapterResponse:
        info = self.admin.unload(request.id, describe)  # raises (and changes nothing) while requests use it
        return pb.UnloadAdapterResponse(adapter=unloaded(info))

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: Context) -> pb.ListAdaptersResponse:
        store = self.runtime.ready().adapters
        return pb.ListAdaptersResponse(adapters=[describe(store, i) for i in store.ids()])

    async def GetAdapter(self, request: pb.GetAdapterRequest, context: Context) -> pb.GetAdapterResponse:
        store = self.runtime.ready().adapters
        check_adapter_id(request.id, field="id")
        return pb.GetAdapterResponse(adapter=describe(store, request.id))
