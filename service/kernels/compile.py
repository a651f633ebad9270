"""One shared library from C++ sources: each source in its own compiler process, all at once, then one link.

    compile_shared(cxx, flags, sources, out, timeout) -> None | str     None when built, else the compiler's errors

Used by ``service.kernels.native.build``. On 2 cores the kernels build in the time of their slowest source
(``lora.cpp``, ~3 s with g++ -O3) instead of the sum (~5.6 s): the cold start's largest part.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["compile_shared"]


def compile_shared(cxx: str, flags: Sequence[str], sources: Sequence[Path], out: str, timeout: float) -> str | None:
    """Build the library ``out`` from ``sources``, ``flags`` given to every compile and to the link; the objects
    live in a temporary folder beside ``out``. None when it built, else the failing steps' error output. Raises
    ``subprocess.TimeoutExpired`` past ``timeout`` seconds in all (every compiler process is stopped)."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(deadline - time.monotonic(), 0.001)

    with tempfile.TemporaryDirectory(prefix=".build-", dir=Path(out).parent) as work:
        objects = [str(Path(work) / f"{i}-{source.stem}.o") for i, source in enumerate(sources)]
        pipe, quiet = subprocess.PIPE, subprocess.DEVNULL
        procs = [
            subprocess.Popen([cxx, *flags, "-c", str(source), "-o", obj], stdout=quiet, stderr=pipe, text=True)
            for source, obj in zip(sources, objects, strict=True)
        ]
        errors = []
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=left())
                if proc.returncode:
                    errors.append(err.strip())
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if errors:
            return "\n".join(errors)
        done = subprocess.run([cxx, *flags, *objects, "-o", out], capture_output=True, text=True, timeout=left(),
                              check=False)  # fmt: skip
        return done.stderr.strip() if done.returncode else None
