"""Which code measured a benchmark's numbers: the checkout's commit, recorded with every result."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_commit() -> str:
    """The checkout's short commit, with "+changes" where its tracked files differ from it (numbers measured on
    uncommitted code say so); "unknown" outside a git checkout."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if head.returncode != 0:
        return "unknown"
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+changes" if changed else "")
