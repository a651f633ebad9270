"""loraplex's side of bench/peers.py: one ``loraplex serve`` per configuration, the rows over gRPC (AsyncClient).

A configuration is a name and extra ``loraplex serve`` flags (``--dtype bfloat16``, ``--quantize int4``, ...);
``{gguf}`` and ``{model}`` in them are replaced by the Q4_1 GGUF's and the model folder's paths. A configuration
whose flags this server does not have (``serve --help`` lacks them) is skipped, named, with the missing flags. The
server is started by this process, registers the LoRAs with ``--adapter-dir`` and is stopped after its rows; its
peak RSS (VmHWM) is read just before it stops. Each row sends all its requests at once, streams them, and checks
that every request got exactly ``NEW_TOKENS`` tokens. Every row is warmed up once, then the measured runs take the
rows in turn (run 1 of every row, then run 2, ...), so that the VM's drift hits every row alike and ratios between
rows of one server (LoRA against base-only) compare like with like.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_workload import NEW_TOKENS, Row, peak_rss_bytes, prompt, summarise
from serve import wait_serving

ROOT = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-m", "service.cli", "serve"]


@dataclass(frozen=True)
class Config:
    """``name=FLAGS`` of ``--loraplex-config``."""

    name: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Config:
        name, sep, flags = text.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--loraplex-config wants NAME=FLAGS, got {text!r}")
        return cls(name.strip(), tuple(shlex.split(flags)))

    def dtype(self) -> str | None:
        """The activation dtype the flags ask for (``--dtype X`` / ``--dtype=X``), None if they leave the default."""
        for i, flag in enumerate(self.flags):
            if flag == "--dtype" and i + 1 < len(self.flags):
                return self.flags[i + 1]
            if flag.startswith("--dtype="):
                return flag.split("=", 1)[1]
        return None

    def expanded(self, paths: dict[str, str]) -> list[str]:
        return [flag.format(**paths) for flag in self.flags]


def serve_help() -> str:
    return subprocess.run([*SERVE, "--help"], capture_output=True, text=True, check=True, cwd=ROOT).stdout


def missing_flags(config: Config, help_text: str) -> list[str]:
    """The ``--flags`` of ``config`` that ``loraplex serve --help`` does not list."""
    names = {flag.split("=", 1)[0] for flag in config.flags if flag.startswith("--")}
    return sorted(n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", help_text))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``loraplex serve`` child on 127.0.0.1:``port``; its stderr goes to ``log``."""

    def __init__(self, model: Path, flags: list[str], adapters: Path | None, port: int, log: Path) -> None:
        args = [*SERVE, "--model", str(model), "--port", str(port), "--metrics-port", "-1", "--http-port", "-1"]
        args += ["--max-batch-size", "32", "--max-total-tokens", "512", "--max-prompt-tokens", "256"]
        if adapters is not None:
            args += ["--adapter-dir", str(adapters)]
        self.target = f"127.0.0.1:{port}"
        self.log = log.open("w")
        start = time.monotonic()
        self.proc = subprocess.Popen([*args, *flags], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            self.ready_s = wait_serving(self.target, start, timeout=300)
        except TimeoutError:
            self.stop()
            raise

    def peak_rss(self) -> int:
        return peak_rss_bytes(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


async def batch_wall(target: str, row: Row, adapters: list[str]) -> tuple[float, list[int]]:
    """Send ``row``'s requests at once; wall seconds until the last one finished, and request 0's token ids."""
    from loraplex import AsyncClient

    async with AsyncClient(target) as client:
        await client.health()  # the channel is connected before the clock starts

        async def one(i: int) -> list[int]:
            a = row.adapter_of(i)
            ids: list[int] = []
            async for delta in client.stream(
                prompt(i),
                adapter=adapters[a] if a is not None else None,
                max_new_tokens=NEW_TOKENS,
                ignore_eos=True,
                temperature=0.0,
                return_token_ids=True,
                timeout=600,
            ):
                ids += delta.token_ids
            return ids

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in range(row.requests)))
        wall = time.perf_counter() - start
    if (counts := [len(ids) for ids in outs]) != [NEW_TOKENS] * row.requests:
        raise RuntimeError(f"loraplex {row.key}: token counts {counts}, expected {NEW_TOKENS} each")
    return wall, outs[0]


def run_config(
    config: Config, model: Path, rows: list[Row], loras: list[Path], paths: dict[str, str], runs: int, work: Path
) -> dict[str, Any]:
    """All ``rows`` on a fresh server started with ``config``'s flags; results per row, start time, peak RSS."""
    adapter_dir = loras[0].parent if loras else None
    log = work / f"loraplex-{config.name}.log"
    server = Server(model, config.expanded(paths), adapter_dir, free_port(), log)
    results: dict[str, Any] = {}
    names = [p.name for p in loras]
    try:
        first = {row.key: asyncio.run(batch_wall(server.target, row, names))[1] for row in rows}  # warm-ups
        walls: dict[str, list[float]] = {row.key: [] for row in rows}
        for _ in range(runs):  # the rows in turn, run by run: the machine's drift hits each row alike
            for row in rows:
                walls[row.key].append(asyncio.run(batch_wall(server.target, row, names))[0])
        for row in rows:
            results[row.key] = summarise(walls[row.key], NEW_TOKENS * row.requests, first[row.key])
            print(f"loraplex {config.name} {row.key}: {results[row.key]['tok_s']:.1f} tok/s", flush=True)
        rss = server.peak_rss()
    finally:
        server.stop()
    return {"rows": results, "ready_s": server.ready_s, "peak_rss_bytes": rss, "flags": list(config.flags)}
