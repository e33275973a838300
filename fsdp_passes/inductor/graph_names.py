"""Names of compiled graphs: ``<compile order>_<fwd|bwd>_frame<frame id>.<compile of that frame>``.

The compile order comes first so dump folders sort in compile order.
"""

from __future__ import annotations

import torch.fx as fx

__all__ = ["GraphNamer", "compile_id", "fx_graph_kind"]


def compile_id() -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is not None and cid.frame_id is not None:
            return f"frame{cid.frame_id}.{cid.frame_compile_id}"
    except Exception:  # the compile id is a label only
        pass
    return "frame?"


def fx_graph_kind(graph: fx.Graph) -> str:
    """"bwd" for a backward graph (it takes tangents), "fwd" otherwise."""
    is_bwd = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)
    return "bwd" if is_bwd else "fwd"


class GraphNamer:
    """Hands out graph names in compile order."""

    def __init__(self) -> None:
        self.count = 0

    def new_name(self, kind: str) -> str:
        name = f"{self.count:03d}_{kind}_{compile_id()}"
        self.count += 1
        return name
