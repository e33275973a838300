"""Shared pieces of the benchmark scripts: model construction without full-size weights, a capture that
stops every graph at Inductor's scheduler and runs nothing, the peer configurations, and scoring with the
package's own cost model and simulator.

Nothing here allocates the full model.  The Llama is built on the meta device, sharded by
``fsdp_passes.testing.simple_fsdp`` (which only needs shapes), then each rank-0 shard is materialised with
``torch.empty`` (uninitialised; no kernel ever reads it).  The compile runs on fake tensors; the backward
graph is lowered eagerly (``force_non_lazy_backward_lowering``) so both graphs reach the scheduler during
the first call, and the function returned for the forward raises instead of running, so no real matmul of
the model's size is ever executed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LlamaDims:
    layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int
    seq_len: int
    batch: int = 1

    def params(self) -> int:
        hd = self.dim // self.n_heads
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        block = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.layers * block + 2 * self.vocab * self.dim + self.dim


LLAMA3_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336)
LLAMA3_70B = dict(dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672)
SMOKE = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


def build_sharded_llama(d: LlamaDims, **fsdp_options: Any) -> nn.Module:
    """A SimpleFSDP-sharded Llama (current default process group) whose shards are uninitialised.

    The unsharded model only ever exists on the meta device.
    """
    from fsdp_passes.testing import simple_fsdp
    from fsdp_passes.testing.models import Llama

    with torch.device("meta"):
        model = Llama(d.layers, d.dim, d.n_heads, d.n_kv_heads, d.ffn_dim, d.vocab, d.seq_len)
    simple_fsdp(model, **fsdp_options)
    return model.to_empty(device="cpu")  # allocates the padded shards only


def build_tp_sharded_llama(d: LlamaDims, mesh: Any, *, reshard_after_forward: bool = True,
                           param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype = torch.float32,
                           float8_all_gather: bool = False) -> nn.Module:
    """A Llama made tensor and sequence parallel over ``mesh["tp"]`` (torchtitan's Llama 3 plan), then sharded by
    ``fsdp_passes.data_parallel`` over ``mesh["dp"]``, FSDP2's order; shards uninitialised, the unsharded model
    only on the meta device."""
    from torch.distributed.tensor.parallel import parallelize_module

    from fsdp_passes.frontend import MixedPrecisionPolicy, data_parallel
    from fsdp_passes.testing.models import Llama, llama_tensor_parallel_plan

    with torch.device("meta"):
        model = Llama(d.layers, d.dim, d.n_heads, d.n_kv_heads, d.ffn_dim, d.vocab, d.seq_len)
    parallelize_module(model, mesh["tp"], llama_tensor_parallel_plan(model))
    data_parallel(model, mesh["dp"], reshard_after_forward=reshard_after_forward,
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                  float8_all_gather=float8_all_gather)
    return model.to_empty(device="cpu")


def tokens(d: LlamaDims) -> torch.Tensor:
    return torch.zeros((d.batch, d.seq_len), dtype=torch.long)


# --------------------------------------------------------------------------------------------------
# Capture: compile up to the end of the comm-overlap scheduler passes, run nothing
# --------------------------------------------------------------------------------------------------

class _Stop(Exception):
    pass


class _NothingRuns(Exception):
    pass


def _find(exc: BaseException, kind: type) -> bool:
    from fsdp_passes.inductor.capture import find_in_chain

    return find_in_chain(exc, kind) is not None


@dataclasses.dataclass
class GraphScore:
    """One compiled graph, scored by fsdp_passes' simulator on the order Inductor would generate code in."""

    graph: str
    n_nodes: int
    n_collectives: int
    exposed_comm_ms: float
    makespan_ms: float
    lower_bound_ms: float
    compute_ms: float
    comm_ms: float
    peak_memory_bytes: int
    sched_pass_s: float  # time spent inside reorder_for_compute_comm_overlap_passes
    to_scheduler_s: float = 0.0  # wall time from the start of this graph's inner compile to the scheduler
    compute_flops: float = 0.0  # FLOPs of the compute nodes the adapter sees (the comparability check)
    first_gather_ms: float = 0.0  # the graph's first all-gather in its order (nothing before it to hide it)
    last_reduction_ms: float = 0.0  # its last reduce-scatter / all-reduce (nothing after it to hide it)
    # per process group: its collectives in issue order ("op group bytes dtype") and their summed time
    sequences_by_group: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    comm_ms_by_group: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Recorder:
    """Collects per-graph scores and pass timings during one capture."""

    def __init__(self, cost_model: Any) -> None:
        self.cost_model = cost_model
        self.current = "graph"
        self.graph_start = 0.0
        self.t_before = 0.0
        self.scores: list[GraphScore] = []
        # per score: what ``gap_parts`` needs (dag, timeline, durations, overlap costs), kept out of the JSON
        self.scored: list[tuple] = []
        self.fx_pass_s: dict[str, float] = {}

    def add_fx_time(self, seconds: float) -> None:
        self.fx_pass_s[self.current] = self.fx_pass_s.get(self.current, 0.0) + seconds

    def passes(self, installed: list) -> list:
        def record_before(nodes: list) -> list:
            self.t_before = time.perf_counter()
            return nodes

        def record_after(nodes: list) -> list:
            t_sched = time.perf_counter() - self.t_before
            to_sched = time.perf_counter() - self.graph_start
            self.scores.append(score_nodes(self.current, list(nodes), self.cost_model, t_sched, to_sched,
                                           keep=self.scored))
            raise _Stop()

        return [record_before, *installed, record_after]


def score_nodes(name: str, nodes: list, cost_model: Any, sched_s: float, to_sched_s: float,
                keep: Optional[list] = None) -> GraphScore:
    """``keep``: appended (dag, timeline, durations, overlap costs), for ``gap_parts`` once the run is over."""
    from fsdp_passes.inductor.scheduler_adapter import dag_from_scheduler_nodes
    from fsdp_passes.pipeline.report import collective_sequence
    from fsdp_passes.simulate import simulate

    from fsdp_passes.dag.graph import CollectiveOp, NodeKind

    dag = dag_from_scheduler_nodes(nodes)  # inside the graph's lowering: graph outputs are known
    durations = cost_model.estimate(dag)
    tl = simulate(dag, list(range(len(dag))), durations, cost_model.overlap_costs())
    if keep is not None:
        keep.append((dag, tl, durations, cost_model.overlap_costs()))
    gathers = [i for i, n in enumerate(dag.nodes)
               if n.kind is NodeKind.COLLECTIVE and n.collective is CollectiveOp.ALL_GATHER]
    reductions = [i for i, n in enumerate(dag.nodes) if n.kind is NodeKind.COLLECTIVE
                  and n.collective in (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE)]
    sequences: dict[str, list[str]] = {}
    for item in collective_sequence(dag):
        sequences.setdefault(item.split(" ")[1], []).append(item)
    comm_by_group: dict[str, float] = {}
    for i, n in enumerate(dag.nodes):
        if n.kind is NodeKind.COLLECTIVE:
            comm_by_group[n.group_name or "?"] = comm_by_group.get(n.group_name or "?", 0.0) + float(durations[i])
    return GraphScore(graph=name, n_nodes=len(dag), n_collectives=len(dag.collectives()),
                      exposed_comm_ms=tl.exposed_total, makespan_ms=tl.makespan, lower_bound_ms=tl.lower_bound,
                      compute_ms=tl.compute_busy, comm_ms=tl.comm_total, peak_memory_bytes=tl.peak_memory,
                      sched_pass_s=sched_s, to_scheduler_s=to_sched_s,
                      compute_flops=float(sum(n.flops for n in dag.nodes if n.kind is NodeKind.COMPUTE)),
                      first_gather_ms=float(durations[gathers[0]]) if gathers else 0.0,
                      last_reduction_ms=float(durations[reductions[-1]]) if reductions else 0.0,
                      sequences_by_group=sequences, comm_ms_by_group=comm_by_group)


def capture_to_scheduler(model: nn.Module, args: tuple, recorder: Recorder,
                         config_patches: Optional[dict] = None, sched_passes: Optional[list] = None) -> float:
    """Compile ``model(*args)`` forward and backward up to the scheduler; returns the wall time in s.

    ``sched_passes``: what goes between the recorder's passes in ``reorder_for_compute_comm_overlap_passes``
    (None: whatever is installed now).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def dead(_args: list) -> list:
        raise _NothingRuns()

    dead._boxed_call = True  # type: ignore[attr-defined]

    def inner_compile(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        recorder.current = "backward" if kwargs.get("is_backward") else "forward"
        recorder.graph_start = time.perf_counter()
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except BaseException as e:  # noqa: BLE001
            if not _find(e, _Stop):
                raise
        return dead

    def backend(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    installed = list(inductor_config.reorder_for_compute_comm_overlap_passes or []) if sched_passes is None \
        else list(sched_passes)
    patches = {"fx_graph_cache": False, "fx_graph_remote_cache": False, "deterministic": False,
               "reorder_for_compute_comm_overlap": True,
               "reorder_for_compute_comm_overlap_passes": recorder.passes(installed)}
    patches.update(config_patches or {})
    torch._dynamo.reset()
    start = time.perf_counter()
    with inductor_config.patch(patches), functorch_config.patch(enable_autograd_cache=False,
                                                                force_non_lazy_backward_lowering=True):
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        try:
            compiled(*args)
        except BaseException as e:  # noqa: BLE001
            if not _find(e, _NothingRuns):
                raise
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# Machine description and run statistics
# --------------------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem_gib, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max over repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


def fmt_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for k, r in enumerate(cells):
        out.append("  ".join(c.rjust(w) if k and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]
