"""Print the CPU capabilities below this machine's best that torch can be forced to here, one per line.

``make test`` runs the whole suite under the machine's own best capability, then reruns the numerics subset
(``pytest -m numerics``) once per capability this prints, with ``ATEN_CPU_CAPABILITY`` set: so an AVX-512 machine
also proves torch's AVX2 and generic kernels, and an AVX2-only one the generic kernels. A capability is printed
only if a fresh interpreter with it forced reports it (torch ignores values the CPU cannot run).

Usage: ``python scripts/cpu_capabilities.py``
"""

from __future__ import annotations

import os
import subprocess
import sys

CANDIDATES = ("default", "avx2")  # torch's generic kernels and the AVX2 ones: what other nodes in a pool run
PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability())"


def reported(capability: str | None) -> str:
    """What torch reports in a fresh interpreter with ``ATEN_CPU_CAPABILITY=capability`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def main() -> int:
    best = reported(None)
    for capability in CANDIDATES:
        if capability.upper() != best and reported(capability) == capability.upper():
            print(capability)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
