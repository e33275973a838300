"""``benchmarks/results/`` holds only files the docs cite (older runs live in git history), and every results file
the docs cite is there (``gpu_check.json`` excepted until a GPU run is recorded)."""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
NOT_YET_RUN = {"gpu_check.json"}  # written by ./dev.sh gpu-check on a GPU


def _expand_braces(name: str) -> list[str]:
    """``a_{8,16}b`` -> ``a_8b``, ``a_16b``."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_patterns() -> set[str]:
    """Every ``*.json`` name in docs/*.md (glob patterns and ``{a,b}`` included), bare or under a ``results/``
    folder; names under any other folder (``/tmp/smoke.json``, ``tests/cost_model/data/...``) are not results."""
    patterns = set()
    for page in (REPO / "docs").glob("*.md"):
        for folder, name in re.findall(r"((?:[\w.~-]+/)*)([\w*{},]+\.json)", page.read_text()):
            if folder and not folder.endswith("results/"):
                continue
            patterns.update(_expand_braces(name))
    return patterns


def test_every_results_file_is_cited_by_the_docs():
    patterns = cited_patterns()
    files = sorted(p.name for p in RESULTS.glob("*.json"))
    uncited = [f for f in files if not any(fnmatch.fnmatchcase(f, pat) for pat in patterns)]
    assert files and not uncited, f"results files no page cites (delete them, git history keeps them): {uncited}"


def test_every_cited_results_file_exists():
    files = {p.name for p in RESULTS.glob("*.json")}
    # only names that look like results files: the docs also name dump files (summary.json, dag.json ...)
    result_like = {pat for pat in cited_patterns() if any(fnmatch.fnmatchcase(f, pat) for f in files)
                   or pat.split("_")[0] in {f.split("_")[0] for f in files}}
    missing = [pat for pat in sorted(result_like - NOT_YET_RUN)
               if not any(fnmatch.fnmatchcase(f, pat) for f in files) and "*" not in pat]
    assert not missing, f"cited in docs/ but not in benchmarks/results/: {missing}"
