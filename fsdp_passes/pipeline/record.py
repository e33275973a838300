"""What the passes did to one compiled graph, and the bounded history of reports users read.

A ``GraphRecord`` is made by whichever pass sees a graph first and travels with that graph (the installed
passes keep it in the compiled graph module's ``meta``), so the scheduler pass of a graph finds what the FX
pass of the same graph did, forward and backward alike, without any state shared between graphs.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .report import GraphReport

__all__ = ["GraphRecord", "ReportHistory"]


@dataclass
class GraphRecord:
    """One compiled graph: its name (compile order, kind, frame) and the report of each pass that ran on it."""

    name: str
    fx: GraphReport | None = None
    scheduler: GraphReport | None = None


class ReportHistory:
    """The newest ``max_reports`` reports, oldest first."""

    def __init__(self, max_reports: int = 256) -> None:
        self._reports: collections.deque[GraphReport] = collections.deque(maxlen=max_reports)

    def add(self, report: GraphReport) -> None:
        self._reports.append(report)

    def reports(self, clear: bool = False) -> list[GraphReport]:
        out = list(self._reports)
        if clear:
            self._reports.clear()
        return out
