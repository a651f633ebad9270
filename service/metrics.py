"""Every Prometheus metric loraplex exports, defined once.

Conventions: base units (``_seconds``, ``_bytes``), counters end in ``_total``, labels are bounded
(stage, mode, status code, tier). An ``adapter`` label exists only on the per-adapter families at the end, and
only through ``ADAPTERS`` (``AdapterLabels``), which caps its distinct values at ``--metrics-adapter-series``.
The table in docs/metrics.md documents each metric; ``tests/metrics/test_metrics_doc.py`` keeps that table and this
module in step.

All metrics live in ``REGISTRY`` (not prometheus_client's global one) so the exposition contains exactly
what this module declares plus the process collector.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)


# Every metric below is built through these three, so each lands in REGISTRY and nowhere else.
def _counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    return Counter(name, doc, labels, registry=REGISTRY)


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    return Gauge(name, doc, labels, registry=REGISTRY)


def _histogram(name: str, doc: str, labels: Sequence[str] = (), *, buckets: Sequence[float]) -> Histogram:
    return Histogram(name, doc, labels, buckets=buckets, registry=REGISTRY)


# Load times span 10 ms (a small file, warm cache) to minutes (a 70B model, cold disk).
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Request latencies: sub-millisecond GPU steps to multi-second CPU generations, up to an hour (a queue wait plus
# max_new_tokens on a slow CPU). A quantile past the top finite bucket reads as that bucket; the dashboard's
# overflow panel shows the share of observations there.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip

BUILD_INFO = Info("loraplex_build", "Version and runtime of this server.", registry=REGISTRY)

# --- model load -----------------------------------------------------------------------------------------
MODEL_LOAD_DURATION = _histogram(
    "loraplex_model_load_duration_seconds",
    "Base model load time by stage (header, read, convert, total) and load mode.",
    ["stage", "mode"],
    buckets=LOAD_BUCKETS,
)
MODEL_LOAD_BYTES = _counter(
    "loraplex_model_load_bytes_total", "Bytes of base model weights read from checkpoint files.", ["mode"]
)
MODEL_LOADED = _gauge("loraplex_model_loaded", "1 once the base model is loaded and the server can serve it.")
COMPUTE_INFO = Info(
    "loraplex_compute",
    "What this replica computes with: torch's CPU capability (or the GPU), serving dtype, weight source "
    "(folder / gguf), loraplex's compiled kernels (avx512 / avx2 / generic, or eager), and the start-up "
    "self-check's outcome (ok / fallback).",
    registry=REGISTRY,
)
SELF_CHECK_FALLBACKS = _gauge(
    "loraplex_self_check_fallbacks",
    "Compute paths the start-up self-check found wrong on this machine and replaced by a correct one.",
)
MODEL_PARAMETER_BYTES = _gauge(
    "loraplex_model_parameter_bytes", "Bytes held by the base model's parameters in their serving dtype."
)

# --- requests ---------------------------------------------------------------------------------------------
REQUESTS = _counter(
    "loraplex_requests_total",
    "Finished RPCs and HTTP API calls (method http.chat, http.completions, http.models) by method and gRPC status "
    "code.",
    ["method", "code"],
)
TIME_TO_FIRST_TOKEN = _histogram(
    "loraplex_time_to_first_token_seconds",
    "From request arrival to its first generated token.",
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = _histogram(
    "loraplex_inter_token_latency_seconds", "Time between consecutive tokens of one request.", buckets=LATENCY_BUCKETS
)
REQUEST_LATENCY = _histogram(
    "loraplex_request_duration_seconds",
    "End-to-end latency of a generation, arrival to last token.",
    buckets=LATENCY_BUCKETS,
)
QUEUE_TIME = _histogram(
    "loraplex_request_queue_seconds", "Time a request waits before its prefill starts.", buckets=LATENCY_BUCKETS
)
PROMPT_TOKENS = _counter("loraplex_prompt_tokens_total", "Prompt tokens prefilled.")
PREFIX_CACHE_HIT_TOKENS = _counter(
    "loraplex_prefix_cache_hit_tokens_total",
    "Prompt tokens whose K/V came from the prefix cache instead of a prefill (included in prompt tokens).",
)
PREFIX_CACHE_BLOCKS = _gauge("loraplex_prefix_cache_blocks", "Prompt blocks held by the prefix cache.")
PREFILL_CHUNKS = _counter(
    "loraplex_prefill_chunks_total",
    "Prompt chunks computed: one per row per prefill pass (a prompt longer than --prefill-chunk-tokens takes several).",
)
PREFILL_PASS_SECONDS = _histogram(
    "loraplex_prefill_pass_seconds",
    "Wall time of each prefill pass: what the running streams wait for between two decode steps.",
    buckets=LATENCY_BUCKETS,
)
HEAD_SCREEN_ROWS = _counter(
    "loraplex_head_screen_rows_total",
    "Rows of greedy steps whose argmax the Q8_0 head found with its int8 screen (outcome=screened: a few logits "
    "computed exactly) or, the screen unable to rule, from every logit (outcome=full).",
    ["outcome"],
)
GENERATED_TOKENS = _counter("loraplex_generated_tokens_total", "Tokens generated.")
RUNNING_REQUESTS = _gauge("loraplex_running_requests", "Requests in the running batch.")
WAITING_REQUESTS = _gauge("loraplex_waiting_requests", "Requests queued for admission.")
BATCH_SIZE = _histogram("loraplex_batch_size", "Rows per forward step.", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
KV_CACHE_USAGE = _gauge("loraplex_kv_cache_usage_ratio", "Fraction of KV cache slots held by running requests.")
# The inference gateway's model-server protocol (vLLM's vllm:lora_requests_info): one series at a time, published
# by the engine once per step through LORA_INFO (below); its value is the time of that step, so a scraper can tell
# the newest label set.
LORA_REQUESTS_INFO = _gauge(
    "loraplex_lora_requests_info",
    "Adapters of the running rows and of the queued rows (comma-separated ids) and max_lora (the most distinct "
    "adapters one batch runs: --max-batch-size); value: Unix time of the engine step that published it.",
    ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
)
ENGINE_STEP_FAILURES = _counter(
    "loraplex_engine_step_failures_total",
    "Engine steps that raised: their requests failed with INTERNAL, the engine went on.",
)
ENGINE_THREADS = _gauge(
    "loraplex_engine_threads",
    "Intra-op threads the engine's decode steps run with now (below the budget while the CPUs are contended).",
)
ENGINE_THREADS_BUDGET = _gauge(
    "loraplex_engine_threads_budget",
    "Most intra-op threads the engine may use: --threads, or min(affinity, cgroup CPU quota, physical cores).",
)

# --- adapters ---------------------------------------------------------------------------------------------
ADAPTER_LOAD_DURATION = _histogram(
    "loraplex_adapter_load_duration_seconds",
    "Adapter load time by stage (index = registration, read, validate = the finiteness check of what was read, "
    "layout, total = request to resident) and by the tier the bytes came from (disk, host).",
    ["stage", "tier"],
    buckets=LOAD_BUCKETS,
)
ADAPTER_EVICTIONS_UNUSED = _counter(
    "loraplex_adapter_evictions_unused_total",
    "Adapters evicted from a tier before any request used them since their load: a working set thrashing the "
    "tier (each is a wasted load; stays 0 while loads wait for room).",
    ["tier"],
)
ADAPTER_OVERFLOW_LOADS = _counter(
    "loraplex_adapter_overflow_loads_total",
    "Adapter loads laid out beyond the device budget because every adapter on the device tier was held "
    "(--adapter-overflow-adapters; their bytes are charged to the host budget).",
)
ADAPTER_OVERFLOW_BYTES = _gauge(
    "loraplex_adapter_overflow_bytes",
    "Bytes of adapter copies laid out beyond the device budget now (overflow copies, charged to the host budget).",
)
ADAPTER_CACHE_EVENTS = _counter(
    "loraplex_adapter_cache_events_total",
    "Adapter tier events: hit / miss (device: a request found it resident or queued a load; host: a load reused "
    "the host copy or read the disk) and eviction (device: to the host tier; host: to disk only).",
    ["event", "tier"],
)
ADAPTER_RESIDENT = _gauge("loraplex_adapter_resident", "Adapters resident on each tier (device, host).", ["tier"])
ADAPTER_RESIDENT_BYTES = _gauge(
    "loraplex_adapter_resident_bytes", "Bytes of adapter weights held on each tier (device, host).", ["tier"]
)
ADAPTER_BUDGET_BYTES = _gauge(
    "loraplex_adapter_budget_bytes", "Byte budget of each adapter tier (device, host).", ["tier"]
)
ADAPTER_READ_BYTES = _counter("loraplex_adapter_read_bytes_total", "Bytes of adapter weights read from adapter files.")
ADAPTERS_REGISTERED = _gauge("loraplex_adapters_registered", "Adapters registered.")

# --- speculative decoding (Medusa heads, prompt lookup) --------------------------------------------------------
SPECULATIVE_DRAFTED = _counter(
    "loraplex_speculative_drafted_tokens",
    "Draft tokens proposed by a drafter (Medusa heads, prompt lookup) and verified.",
)
SPECULATIVE_ACCEPTED = _counter(
    "loraplex_speculative_accepted_tokens", "Draft tokens accepted by verification (each saves one forward pass)."
)
SPECULATIVE_STEPS = _counter(
    "loraplex_speculative_steps",
    "Row-steps that verified drafts; accepted / steps + 1 = mean tokens per step of a speculating row.",
)

# --- output constraints (JSON schema, regex, grammars) -------------------------------------------------------
# Grammar work is milliseconds or less: compiles of typical schemas, one step's masks for a batch.
CONSTRAINT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
CONSTRAINT_COMPILE_SECONDS = _histogram(
    "loraplex_constraint_compile_seconds",
    "Time to compile one output constraint (a cache miss), on the worker pool.",
    buckets=CONSTRAINT_BUCKETS,
)
CONSTRAINT_CACHE_LOOKUPS = _counter(
    "loraplex_constraint_cache_lookups_total",
    "Compiled-grammar cache lookups by result (hit, miss).",
    ["result"],
)
for _result in ("hit", "miss"):  # both series exist from the start, so a hit ratio is defined before the first miss
    CONSTRAINT_CACHE_LOOKUPS.labels(_result)
CONSTRAINT_CACHE_BYTES = _gauge(
    "loraplex_constraint_cache_bytes", "Bytes charged to the compiled grammars the cache holds (an estimate)."
)
CONSTRAINT_MASK_SECONDS = _histogram(
    "loraplex_constraint_mask_seconds",
    "Time to compute one step's token masks for every constrained row, on the mask thread beside the forward pass.",
    buckets=CONSTRAINT_BUCKETS,
)
CONSTRAINT_MASK_WAIT_SECONDS = _histogram(
    "loraplex_constraint_mask_wait_seconds",
    "Time the engine waited for a step's masks after its forward pass (0 when the masks were ready).",
    buckets=CONSTRAINT_BUCKETS,
)
CONSTRAINT_DEAD_ENDS = _counter(
    "loraplex_constraint_dead_ends_total",
    "Requests ended because their constraint allowed no next token (finish reason dead_end).",
)

# --- per adapter (labels only through ADAPTERS below) -----------------------------------------------------------
ADAPTER_REQUESTS = _counter(
    "loraplex_adapter_requests",
    "Finished generation RPCs by adapter and gRPC status code (client deadlines as DEADLINE_EXCEEDED).",
    ["adapter", "code"],
)
ADAPTER_GENERATED_TOKENS = _counter(
    "loraplex_adapter_generated_tokens", "Tokens generated, by adapter; counted when the request finishes.", ["adapter"]
)
ADAPTER_TIME_TO_FIRST_TOKEN = _histogram(
    "loraplex_adapter_time_to_first_token_seconds",
    "From request arrival to its first generated token, by adapter.",
    ["adapter"],
    buckets=LATENCY_BUCKETS,
)
ADAPTER_LOAD_SECONDS = _histogram(
    "loraplex_adapter_load_seconds",
    "Adapter load time, request to resident (LoRA) or read to ready (Medusa heads), by adapter.",
    ["adapter"],
    buckets=LOAD_BUCKETS,
)
ADAPTER_EVICTIONS = _counter(
    "loraplex_adapter_evictions",
    "Adapter evictions by adapter and the tier it left (device: to the host tier; host: to disk only).",
    ["adapter", "tier"],
)
ADAPTER_TIER_BYTES = _gauge(
    "loraplex_adapter_tier_bytes",
    "Bytes of adapter weights held now, by adapter and tier (device, host); 0 on both: on disk only.",
    ["adapter", "tier"],
)
PER_ADAPTER = (
    ADAPTER_REQUESTS,
    ADAPTER_GENERATED_TOKENS,
    ADAPTER_TIME_TO_FIRST_TOKEN,
    ADAPTER_LOAD_SECONDS,
    ADAPTER_EVICTIONS,
    ADAPTER_TIER_BYTES,
)


class AdapterLabels:
    """The values the ``adapter`` label may take: at most ``cap`` adapter ids, first come first served, for the
    life of the process; every other adapter is counted under ``OTHER``. The base model is ``BASE`` (""), which
    no adapter id can be (ids have 1-128 characters). An adapter whose id is ``other`` shares the overflow series.

    ``admit=False`` maps an id that holds no slot to ``OTHER`` without taking one: the request path uses it for
    ids that are not registered, so unknown ids sent by clients never use up the cap."""

    BASE = ""
    OTHER = "other"

    def __init__(self, cap: int) -> None:
        self._lock = threading.Lock()
        self.cap = cap
        self._slots: dict[str, None] = {}

    def reset(self, cap: int) -> None:
        """A new cap and no slots; clears the per-adapter series (a server starts them afresh)."""
        if cap < 0:
            raise ValueError("metrics_adapter_series must be >= 0")
        with self._lock:
            self.cap = cap
            self._slots.clear()
            for family in PER_ADAPTER:
                family.clear()

    @property
    def values(self) -> tuple[str, ...]:
        """Adapter ids that hold a slot, in the order they took it."""
        with self._lock:
            return tuple(self._slots)

    def label(self, adapter_id: str | None, *, admit: bool = True) -> str:
        if not adapter_id:
            return self.BASE
        with self._lock:
            if adapter_id in self._slots:
                return adapter_id
            if admit and len(self._slots) < self.cap:
                self._slots[adapter_id] = None
                return adapter_id
        return self.OTHER

    # One call per event, from wherever it happens (servicer, engine thread, adapter loader).
    def request_finished(self, adapter_id: str | None, code: str, *, known: bool) -> None:
        ADAPTER_REQUESTS.labels(self.label(adapter_id, admit=known), code).inc()

    def first_token(self, adapter_id: str | None, seconds: float) -> None:
        ADAPTER_TIME_TO_FIRST_TOKEN.labels(self.label(adapter_id)).observe(seconds)

    def generated(self, adapter_id: str | None, tokens: int) -> None:
        if tokens:
            ADAPTER_GENERATED_TOKENS.labels(self.label(adapter_id)).inc(tokens)

    def loaded(self, adapter_id: str, seconds: float) -> None:
        ADAPTER_LOAD_SECONDS.labels(self.label(adapter_id)).observe(seconds)

    def evicted(self, adapter_id: str, tier: str) -> None:
        ADAPTER_EVICTIONS.labels(self.label(adapter_id), tier).inc()

    def resident(self, adapter_id: str, tier: str, delta: int) -> None:
        """``delta`` bytes of the adapter joined (or, negative, left) ``tier``: a change, so that adapters sharing
        the ``other`` series add up."""
        if delta:
            ADAPTER_TIER_BYTES.labels(self.label(adapter_id), tier).inc(delta)


class LoraRequestsInfo:
    """Keeps ``gauge`` (``LORA_REQUESTS_INFO``) at one series: a new label set is written first, then the previous
    one removed (a scrape between the two sees both; the newer has the larger value, which is how the protocol's
    scrapers pick the latest)."""

    def __init__(self, gauge: Gauge) -> None:
        self._lock = threading.Lock()
        self._gauge = gauge
        self._labels: tuple[str, str, str] | None = None

    @property
    def labels(self) -> tuple[str, str, str] | None:
        """The current (running, waiting, max_lora) label values; None before the first publish."""
        return self._labels

    def publish(self, running: Sequence[str], waiting: Sequence[str], max_lora: int) -> None:
        """``running`` / ``waiting``: the adapter ids of the rows, repeats allowed (the first occurrence orders)."""
        labels = (",".join(dict.fromkeys(running)), ",".join(dict.fromkeys(waiting)), str(max_lora))
        with self._lock:
            self._gauge.labels(*labels).set_to_current_time()
            if self._labels is not None and self._labels != labels:
                self._gauge.remove(*self._labels)
            self._labels = labels


LORA_INFO = LoraRequestsInfo(LORA_REQUESTS_INFO)


# The cap until a server starts (service.api.server.start calls ADAPTERS.reset): the default of
# Settings.metrics_adapter_series, spelled here so that metrics imports no configuration (tests/test_structure.py
# checks the two agree).
DEFAULT_ADAPTER_SERIES = 32
ADAPTERS = AdapterLabels(DEFAULT_ADAPTER_SERIES)
