"""The build cache: what a build makes the same way every time it runs with the same inputs, kept between builds.

Each entry is one file under `cache_dir()/KIND/KEY/`, KEY a digest of everything that decides its bytes (sources,
versions, shapes), so a changed input never reads an old entry. An entry appears by rename, whole: builds running
at once may both make it, and neither ever reads half of one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def cache_dir() -> Path:
    """LLM_ENGINE_BUILDER_CACHE_DIR, else $XDG_CACHE_HOME/llm-engine-builder (~/.cache/llm-engine-builder)."""
    configured = os.environ.get("LLM_ENGINE_BUILDER_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-engine-builder"


def digest(parts: Iterable[str | bytes | Path]) -> str:
    """A key for the cache from the parts that decide an entry, a Path standing for its file's name and contents
    (each piece delimited, so no two lists collide)."""
    hashed = hashlib.sha256()
    for part in parts:
        pieces = (part.name, part.read_bytes()) if isinstance(part, Path) else (part,)
        for piece in pieces:
            data = piece.encode() if isinstance(piece, str) else piece
            hashed.update(len(data).to_bytes(8, "little") + data)
    return hashed.hexdigest()[:32]


def cached_file(kind: str, key: str, name: str, make: Callable[[Path], object]) -> Path | None:
    """The entry `kind/key/name`, made now by `make(path)` where there is none yet; None where the cache cannot be
    written (the caller then makes the file where it needs it)."""
    entry = cache_dir() / kind / key / name
    if entry.is_file():
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".making-", dir=entry.parent))
    except OSError:
        return None
    try:
        make(staged / name)
        os.replace(staged / name, entry)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return entry
