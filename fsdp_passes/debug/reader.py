"""Reading dump folders back (``python -m fsdp_passes report`` / ``simulate``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


class DumpError(ValueError):
    """A dump folder that cannot be read; the message is one line naming the path and the problem."""


@dataclass
class GraphDump:
    """One graph folder of a dump: its path and its parsed summary.json."""

    path: str
    summary: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.summary.get("graph") or os.path.basename(self.path))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DumpError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise DumpError(f"{path}: not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DumpError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None


def read_summary(folder: str) -> GraphDump:
    path = os.path.join(folder, "summary.json")
    data = read_json(path)
    if not isinstance(data, dict) or "graph" not in data:
        raise DumpError(f"{path}: not an fsdp_passes summary (no \"graph\" key)")
    return GraphDump(folder, data)


def load_dumps(root: str | os.PathLike[str]) -> list[GraphDump]:
    """The graph dumps under ``root`` in compile order: ``root`` itself if it is one graph's folder,
    else every sub-folder holding a summary.json (sorted by name, which is compile order)."""
    root = os.fspath(root)
    if not os.path.exists(root):
        raise DumpError(f"{root}: no such folder")
    if not os.path.isdir(root):
        raise DumpError(f"{root}: not a folder (expected a dump folder written with debug_dir)")
    if os.path.isfile(os.path.join(root, "summary.json")):
        return [read_summary(root)]
    dumps = [
        read_summary(os.path.join(root, entry))
        for entry in sorted(os.listdir(root))
        if os.path.isfile(os.path.join(root, entry, "summary.json"))
    ]
    if not dumps:
        raise DumpError(f"{root}: no fsdp_passes dumps in it (expected {os.path.join(root, '<graph>', 'summary.json')})")
    return dumps


def pair_dumps(a: list[GraphDump], b: list[GraphDump]) -> list[tuple[GraphDump | None, GraphDump | None]]:
    """Graphs of two dumps matched by name; when the names differ (another process numbered them
    differently) they are matched in compile order instead."""
    names_a = [d.name for d in a]
    names_b = [d.name for d in b]
    if set(names_a) & set(names_b):
        by_b = {d.name: d for d in b}
        pairs: list[tuple[GraphDump | None, GraphDump | None]] = [(d, by_b.pop(d.name, None)) for d in a]
        pairs.extend((None, d) for d in b if d.name in by_b)
        return pairs
    n = max(len(a), len(b))
    return [(a[k] if k < len(a) else None, b[k] if k < len(b) else None) for k in range(n)]
