"""Load and soak: mixed-adapter streaming traffic above capacity against a `loraplex serve` this script starts.

    .venv/bin/python bench/loadgen.py                       # load: 60 s above capacity (SmolLM2, 8 adapters)
    .venv/bin/python bench/loadgen.py --soak 600            # soak: 10 min with adapter churn, small device budget
    .venv/bin/python bench/loadgen.py --tiny --duration 20  # the same against a tiny random model (seconds)

Not part of CI. The server runs on loopback with a small ``--max-batch-size`` and ``--max-queue``, so more
concurrent clients than batch + queue keeps it saturated and part of the traffic is refused with
RESOURCE_EXHAUSTED (a refused client backs off a little and tries again). Every request is greedy with
``ignore_eos`` and ``max_new_tokens = --new-tokens``, so an accepted request must end with exactly that many
tokens and FINISH_REASON_LENGTH; anything else counts as an unexpected error. Traffic mixes the base model and
``--adapters`` tiny random PEFT LoRAs (written to a work folder, rank ``--rank`` on ``--targets``) and, in a soak, the
adapter device budget holds only about a third of them while a churn task unloads and re-registers one adapter
every ``--churn-every`` seconds (it withdraws the adapter from the traffic and waits for its requests first, so
churn itself causes no NOT_FOUND). Probes (fixed prompt, adapter, greedy) are answered once at the start and
re-checked every ``--probe-every`` seconds: the text must not change. The server's RSS (``VmRSS`` in
``/proc/PID/status``) is sampled every ``--rss-every`` seconds; the report gives start, end and the least-squares
slope in MB/min.

Prints one summary and writes it as JSON (``--json``); exits 1 when a check fails: an unexpected error, an
accepted request that did not complete in full, a probe whose answer changed, or a rejection p99 above
``--max-reject-p99``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loraplex.v1 import adapters_pb2 as apb
from loraplex.v1 import adapters_pb2_grpc as apb_grpc
from loraplex.v1 import generation_pb2 as pb
from loraplex.v1 import generation_pb2_grpc as pb_grpc
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench/.work/loadgen"
SMOLLM2 = ROOT / "models/SmolLM2-135M-Instruct"
PROMPTS = [
    "What is the capital of France?", "Why is the sky blue?", "Name three primary colors.",
    "How do plants make food?", "What is a prime number?", "Explain gravity in one sentence.",
    "What does a CPU do?", "Who wrote Romeo and Juliet?", "How many legs does a spider have?",
    "What is the largest ocean?", "How does a rainbow form?", "Why do we sleep?",
]  # fmt: skip
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


# --- files ------------------------------------------------------------------------------------------------------
def write_tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (what tests/conftest.py serves as ``served_tiny_dir``)."""
    if (folder / "model.safetensors").exists():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (SMOLLM2 / name).exists():
            shutil.copy(SMOLLM2 / name, folder / name)
    return folder


def write_adapters(model: Path, folder: Path, count: int, rank: int, targets: list[str]) -> tuple[list[str], int]:
    """``count`` PEFT LoRA folders with seeded random A and B on ``targets`` (attention projections); (ids, bytes
    each). The folder name records rank and targets, so a folder is reused only for the same adapters."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    features = {m: shapes[m] for m in targets}
    ids = [f"lg{i:02d}" for i in range(count)]
    nbytes = layers * sum(rank * (i + o) for i, o in features.values()) * 4
    for n, adapter_id in enumerate(ids):
        out = folder / adapter_id
        if (out / "adapter_model.safetensors").exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(1000 + n)
        tensors = {}
        for layer in range(layers):
            for module, (fin, fout) in features.items():
                key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) / rank**0.5
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(features), "bias": "none"}
        (out / "adapter_config.json").write_text(json.dumps(config))
    return ids, nbytes


# --- the server ---------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, model: Path, adapters: Path, port: int, args: argparse.Namespace, budget: int) -> None:
        self.target = f"127.0.0.1:{port}"
        self.log = (WORK / "server.log").open("w")
        cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--port", str(port)]
        cmd += ["--dtype", "float32"]
        cmd += ["--metrics-port", "-1", "--adapter-dir", str(adapters), "--max-batch-size", str(args.max_batch_size)]
        cmd += ["--http-port", "-1"]
        cmd += ["--max-queue", str(args.max_queue), "--max-total-tokens", "1024", "--max-prompt-tokens", "512"]
        cmd += ["--adapter-device-budget-bytes", str(budget)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'clients/python'}"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_serving(time.monotonic() + 300)

    def _wait_serving(self, deadline: float) -> None:
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:  # SERVING
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not SERVING (exit {self.proc.returncode}); see {WORK / 'server.log'}")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# --- traffic ------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    accepted: int = 0
    completed: int = 0
    rejected: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # unexpected: status code (or INCOMPLETE) -> count
    latency: list[float] = field(default_factory=list)  # completed requests: send -> last message
    ttft: list[float] = field(default_factory=list)
    reject_latency: list[float] = field(default_factory=list)  # send -> RESOURCE_EXHAUSTED
    churn: Counter[str] = field(default_factory=Counter)
    probes: int = 0  # rounds of probes compared with the first answers
    probes_crowded_out: int = 0  # probe comparisons skipped: a full queue kept the probe out too long
    probe_mismatches: list[str] = field(default_factory=list)


class Traffic:
    def __init__(self, target: str, adapters: list[str], args: argparse.Namespace) -> None:
        self.target = target
        self.args = args
        self.available = set(adapters)  # the adapters traffic may pick (churn withdraws one at a time)
        self.in_use: Counter[str] = Counter()
        self.tally = Tally()
        self.rng = random.Random(args.seed)

    def request(self, prompt: str, adapter: str | None, new_tokens: int) -> pb.GenerateStreamRequest:
        return pb.GenerateStreamRequest(
            input=pb.Input(text=prompt, chat=True),
            adapter_id=adapter or "",
            stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            return_options=pb.ReturnOptions(return_token_ids=True),
        )

    async def one(self, stub: pb_grpc.GenerationStub) -> None:
        t = self.tally
        pool = sorted(self.available)
        adapter = None if not pool or self.rng.random() < self.args.base_fraction else self.rng.choice(pool)
        n = self.args.new_tokens
        request = self.request(self.rng.choice(PROMPTS), adapter, n)
        if adapter is not None:
            self.in_use[adapter] += 1
        t.sent += 1
        sent = time.perf_counter()
        tokens, finish, first = 0, pb.FINISH_REASON_UNSPECIFIED, None
        try:
            async for message in stub.GenerateStream(request, timeout=self.args.request_timeout):
                if first is None:
                    first = time.perf_counter()
                    t.accepted += 1
                tokens += len(message.token_ids)
                finish = message.finish_reason or finish
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and first is None:
                t.rejected += 1
                t.reject_latency.append(time.perf_counter() - sent)
                await asyncio.sleep(self.rng.uniform(*self.args.backoff))  # back off, then try again
                return
            if first is None:
                t.accepted += 1  # admitted, then failed
            t.errors[e.code().name] += 1
            return
        finally:
            if adapter is not None:
                self.in_use[adapter] -= 1
        if tokens == n and finish == pb.FINISH_REASON_LENGTH:
            t.completed += 1
            t.latency.append(time.perf_counter() - sent)
            t.ttft.append((first or sent) - sent)
        else:
            t.errors["INCOMPLETE"] += 1

    async def client(self, stub: pb_grpc.GenerationStub, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await self.one(stub)

    async def probe_answers(
        self, stub: pb_grpc.GenerationStub, probes: list[tuple[str, str | None]]
    ) -> list[str | None]:
        """Each probe's text; None when a full queue kept it out for ``--request-timeout`` seconds."""
        out: list[str | None] = []
        for prompt, adapter in probes:
            request = self.request(prompt, adapter, self.args.new_tokens)
            text, give_up = None, time.monotonic() + self.args.request_timeout
            while text is None and time.monotonic() < give_up:
                try:
                    text = "".join([m.text async for m in stub.GenerateStream(request, timeout=120)])
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    await asyncio.sleep(0.05)
            out.append(text)
        return out

    async def prober(self, stub: pb_grpc.GenerationStub, probes: list[tuple[str, str | None]], stop_at: float) -> None:
        expected = await self.probe_answers(stub, probes)
        while time.monotonic() + self.args.probe_every < stop_at:
            await asyncio.sleep(self.args.probe_every)
            got = await self.probe_answers(stub, probes)
            self.tally.probes += 1
            for (prompt, adapter), want, have in zip(probes, expected, got, strict=True):
                if want is None or have is None:
                    self.tally.probes_crowded_out += 1
                elif want != have:
                    self.tally.probe_mismatches.append(f"{adapter or 'base'} {prompt!r}: {want!r} -> {have!r}")

    async def churner(self, adapters: apb_grpc.AdaptersStub, pool: list[str], folder: Path, stop_at: float) -> None:
        """Every ``--churn-every`` s: withdraw one adapter, wait for its requests, unload it, register it again."""
        i = 0
        while time.monotonic() + self.args.churn_every < stop_at:
            await asyncio.sleep(self.args.churn_every)
            adapter = pool[i % len(pool)]
            i += 1
            self.available.discard(adapter)
            while self.in_use[adapter]:
                await asyncio.sleep(0.01)
            for _ in range(100):
                try:
                    await adapters.UnloadAdapter(apb.UnloadAdapterRequest(id=adapter), timeout=30)
                    self.tally.churn["unloaded"] += 1
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # still pinned: try again shortly
                        raise
                    self.tally.churn["unload_busy"] += 1
                    await asyncio.sleep(0.05)
            await adapters.LoadAdapter(apb.LoadAdapterRequest(id=adapter, source=str(folder / adapter)), timeout=60)
            self.tally.churn["loaded"] += 1
            self.available.add(adapter)


async def sample_rss(server: Server, samples: list[tuple[float, float]], every: float, stop_at: float) -> None:
    start = time.monotonic()
    while time.monotonic() < stop_at:
        samples.append((time.monotonic() - start, server.rss_mb()))
        await asyncio.sleep(every)


async def run(server: Server, adapters: list[str], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    traffic = Traffic(server.target, adapters, args)
    seconds = args.soak or args.duration
    rss: list[tuple[float, float]] = []
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        probes = [(PROMPTS[0], None), *((PROMPTS[i % len(PROMPTS)], a) for i, a in enumerate(adapters[:3]))]
        await traffic.probe_answers(stub, probes)  # warm-up: first loads, first steps
        stop_at = time.monotonic() + seconds
        tasks = [traffic.client(stub, stop_at) for _ in range(args.concurrency)]
        tasks += [traffic.prober(stub, probes, stop_at), sample_rss(server, rss, args.rss_every, stop_at)]
        if args.soak:
            churn_pool = [a for a in adapters if a not in {p[1] for p in probes}]
            tasks.append(traffic.churner(apb_grpc.AdaptersStub(channel), churn_pool, folder, stop_at))
        started = time.perf_counter()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return report(traffic.tally, rss, wall, args)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mt, mr = sum(t for t, _ in samples) / n, sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (r - mr) for t, r in samples) / var if var else float("nan")


def report(t: Tally, rss: list[tuple[float, float]], wall: float, args: argparse.Namespace) -> dict[str, Any]:
    names = ("sent", "accepted", "completed", "rejected", "probes", "probes_crowded_out")
    out: dict[str, Any] = {k: getattr(t, k) for k in names}
    out.update(errors=dict(t.errors), churn=dict(t.churn), probe_mismatches=t.probe_mismatches)
    out.update(
        mode="soak" if args.soak else "load",
        seconds=round(wall, 1),  # traffic, plus the requests in flight at its end finishing
        model="tiny" if args.tiny else str(args.model),
        completed_per_s=round(t.completed / wall, 2),
        latency_p50_s=pct(t.latency, 0.5),
        latency_p99_s=pct(t.latency, 0.99),
        ttft_p50_s=pct(t.ttft, 0.5),
        ttft_p99_s=pct(t.ttft, 0.99),
        reject_p50_s=pct(t.reject_latency, 0.5),
        reject_p99_s=pct(t.reject_latency, 0.99),
        rss_start_mb=rss[0][1] if rss else float("nan"),
        rss_end_mb=rss[-1][1] if rss else float("nan"),
        rss_max_mb=max((r for _, r in rss), default=float("nan")),
        rss_slope_mb_per_min=slope_mb_per_min(rss),
        rss_slope_second_half_mb_per_min=slope_mb_per_min(rss[len(rss) // 2 :]),  # past the first loads
        rss_samples=len(rss),
        rss_series=[[round(t, 1), round(mb, 1)] for t, mb in rss],  # (seconds since the traffic began, MB)
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    )
    problems = [f"unexpected errors {dict(t.errors)}"] if t.errors else []
    if t.accepted != t.completed + sum(t.errors.values()):
        problems.append(f"accepted {t.accepted} != completed {t.completed} + errors {sum(t.errors.values())}")
    if t.probe_mismatches:
        problems.append(f"{len(t.probe_mismatches)} probe answers changed")
    if t.reject_latency and out["reject_p99_s"] > args.max_reject_p99:
        problems.append(f"rejection p99 {out['reject_p99_s']:.3f} s > {args.max_reject_p99} s")
    if not t.rejected:
        problems.append("no request was refused: the load did not exceed capacity (raise --concurrency)")
    out["problems"] = problems
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=SMOLLM2)
    p.add_argument("--tiny", action="store_true", help="serve a tiny random model instead (with SmolLM2's tokenizer)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic in load mode")
    p.add_argument("--soak", type=float, default=0.0, help="seconds of soak (churn on, small budget); >= 600 for real")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="adapted modules (comma-separated)")
    p.add_argument("--base-fraction", type=float, default=0.25, help="share of requests without an adapter")
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="clients, each with one request in flight")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--backoff", type=float, nargs=2, default=(0.05, 0.2), help="seconds a refused client waits")
    p.add_argument("--budget-fraction", type=float, default=1 / 3, help="soak: device budget / adapters' bytes")
    p.add_argument("--churn-every", type=float, default=5.0)
    p.add_argument("--probe-every", type=float, default=30.0)
    p.add_argument("--rss-every", type=float, default=2.0)
    p.add_argument("--max-reject-p99", type=float, default=0.25, help="seconds; queue-full must be answered fast")
    p.add_argument("--port", type=int, default=50777)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> tuple[Path, Path, list[str], int]:
    """The model folder, the adapters' folder, their ids and bytes each (written once, then reused)."""
    WORK.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(WORK / "tiny") if args.tiny else args.model
    targets = args.targets.split(",")
    folder = WORK / f"adapters-{'tiny' if args.tiny else 'model'}-r{args.rank}-{'-'.join(targets)}"
    adapters, each = write_adapters(model, folder, args.adapters, args.rank, targets)
    return model, folder, adapters, each


def write_report(result: dict[str, Any], path: Path | None) -> None:
    print(json.dumps(result, indent=2, sort_keys=True))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, folder, adapters, each = prepare(args)
    budget = max(each, int(each * args.adapters * args.budget_fraction)) if args.soak else 1 << 40
    server = Server(model, folder, args.port, args, budget)
    try:
        result = asyncio.run(run(server, adapters, folder, args))
    finally:
        server.stop()
    result.update(adapter_bytes=each, adapter_device_budget_bytes=budget, server_exit=server.proc.returncode)
    write_report(result, args.json)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
