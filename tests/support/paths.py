"""Where the checkout is: tests that read the repository's own files (docs, deploy/, proto/, bench/) start here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
