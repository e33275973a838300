"""Cache keys of the installed passes.

Each pass object's ``uuid()`` hashes the package's source and data files (its version among them) and the
options, so the FX graph cache misses whenever any of them changes instead of serving a graph compiled with
other options or silently skipping a pass.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from ..options import Options

__all__ = ["options_key", "package_fingerprint", "pass_uuid"]

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def package_fingerprint() -> str:
    """Hash of every source and data file (the version string included): changes whenever the code does."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_ROOT.rglob("*")):
        if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def options_key(options: Options) -> str:
    return json.dumps(options.to_json(), sort_keys=True, default=str)


def pass_uuid(kind: str, options: Options, chained: Any = None) -> str:
    """``kind`` ("fx" / "scheduler"), code, options and the uuid of a user pass chained behind ours."""
    h = hashlib.sha256()
    h.update(kind.encode())
    h.update(package_fingerprint().encode())
    h.update(options_key(options).encode())
    if chained is not None:
        chained_uuid = chained.uuid() if hasattr(chained, "uuid") else repr(chained)
        h.update(repr(chained_uuid).encode())
    return h.hexdigest()
