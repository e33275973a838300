"""A calibration from a profiled training step: ``calibrate_from_trace(path)``.

Reads the Chrome trace ``torch.profiler`` writes (``prof.export_chrome_trace``) of one or more steps of a
compiled model and measures:

* **Compiled kernels**, keyed like ``DagNode.kernel_key`` so the scheduler pass finds them:
  generated kernels by their name stem (``graph_0_cpp_fused_relu_sum_3`` / ``triton_poi_fused_relu_sum_3``
  -> ``fused_relu_sum``; Inductor's C++ kernels appear in a CPU trace only with
  ``torch._inductor.config.cpp.enable_kernel_profile = True``), aten extern kernels of a CPU trace by op
  and input shapes (``aten::mm`` with ``record_shapes=True`` -> ``aten.mm float32[8,64];...``).
  When the trace has device kernels (CUDA: ``cat == "kernel"`` on stream tracks) only those are timed: an
  extern op's time is that of the device kernels it launched (linked by the profiler's ``External id``).
  Each key gets the median of its occurrences.
* **Collectives**, by op, size (the cost model's byte convention) and group size: the time a collective
  ran, which is the device-side event: gloo's ``gloo:all_gather`` / ``gloo:all_reduce`` on its worker
  thread, NCCL's ``ncclDevKernel_*`` kernels.  Each is paired, in issue order, with the
  ``_c10d_functional::*`` op that issued it, which says what it was (gloo runs a tensor reduce-scatter as
  an all-reduce), its input shape and group size.  NCCL kernels that carry ``Collective name`` / ``In msg
  nelems`` / ``Group size`` arguments are read directly.

Everything else (views, copies, the autograd engine) is ignored.  Several steps in one trace are fine (more
samples); a CPU trace of several processes is read per process id and merged; a device trace is read as one
process's (its kernels carry the device's pid, not the process's).
"""

from __future__ import annotations

import os
import re
import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping, Union

from ..dag.collectives import KINDS
from ..dag.graph import CollectiveOp
from .calibration import Calibration, read_json_file

__all__ = ["calibrate_from_trace", "kernel_stem"]

PathLike = Union[str, "os.PathLike[str]"]

_COMPILED_CALL = "## Call CompiledFxGraph"
_GENERATED = re.compile(r"^(?:graph_\d+_)?(?:cpp|triton(?:_[a-z]+)?)_(fused(?:_\w*?)?)_\d+$")
# the issuing ops of one tensor (not the coalesced ones, whose first input is one of several)
_ISSUE_OPS = {f"_c10d_functional::{name}": kind.op for kind in KINDS.values() if kind.op is not CollectiveOp.OTHER
              for name in kind.ops if "coalesced" not in name}
# where the group size sits among each issuing op's arguments, after its input (all_reduce has none: the world
# size is used)
_GROUP_SIZE_ARG = {kind.op: 1 + kind.args.index("group_size") for kind in KINDS.values() if "group_size" in kind.args}
_NCCL_OPS = {name: kind.op for kind in KINDS.values() for name in kind.nccl_names}
_GLOO_OPS = {kind.gloo_name: kind.op for kind in KINDS.values() if kind.gloo_name}
# c10 scalar type names as the profiler prints them -> torch dtype names (and their sizes)
_DTYPES = {"float": ("float32", 4), "double": ("float64", 8), "c10::BFloat16": ("bfloat16", 2),
           "c10::Half": ("float16", 2), "long int": ("int64", 8), "int": ("int32", 4),
           "signed char": ("int8", 1), "unsigned char": ("uint8", 1), "bool": ("bool", 1),
           "c10::Float8_e4m3fn": ("float8_e4m3fn", 1), "c10::Float8_e5m2": ("float8_e5m2", 1)}
_NCCL_DTYPES = {"Float": 4, "Double": 8, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4, "Char": 1, "Byte": 1}


def kernel_stem(name: str) -> str | None:
    """``fused_relu_sum`` of a generated kernel's name (``graph_0_cpp_fused_relu_sum_3``,
    ``triton_poi_fused_relu_sum_3``); None for any other name."""
    m = _GENERATED.match(name)
    return m.group(1) if m else None


def _load_events(path: PathLike) -> tuple[list[Mapping[str, Any]], int | None]:
    """The complete ('X') events of a Chrome trace and the world size the profiler recorded (if any)."""
    name = os.fspath(path)
    data = read_json_file(name, "trace file")
    events = data.get("traceEvents") if isinstance(data, Mapping) else data
    if not isinstance(events, list):
        raise ValueError(f"trace file {name}: expected a Chrome trace (an object with 'traceEvents' or a list)")
    complete = [e for e in events
                if isinstance(e, Mapping) and e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    world = None
    info = data.get("distributedInfo") if isinstance(data, Mapping) else None
    if isinstance(info, Mapping):
        try:
            world = int(info["world_size"])
        except (KeyError, TypeError, ValueError):
            pass
    return complete, world


def _numel(dims: Any) -> int | None:
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        return None
    n = 1
    for d in dims:
        n *= d
    return n


def _shapes(args: Mapping[str, Any]) -> str | None:
    """``float32[8,64];float32[64,128]`` from an op event's recorded shapes (``record_shapes=True``)."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    parts = []
    for d, t in zip(dims, types):
        if t in _DTYPES and isinstance(d, list) and all(isinstance(x, int) for x in d):
            parts.append(f"{_DTYPES[t][0]}[{','.join(map(str, d))}]")
    return ";".join(parts)


def _issue_info(event: Mapping[str, Any], op: CollectiveOp, world: int | None) -> tuple[int, int] | None:
    """(payload bytes in the cost model's convention, group size) of a ``_c10d_functional`` issue event."""
    args = event.get("args") or {}
    dims, types, concrete = args.get("Input Dims"), args.get("Input type"), args.get("Concrete Inputs")
    if not isinstance(dims, list) or not dims or not isinstance(types, list) or not types:
        return None
    numel, dtype = _numel(dims[0]), _DTYPES.get(types[0])
    group = world
    idx = _GROUP_SIZE_ARG.get(op)
    if idx is not None and isinstance(concrete, list) and len(concrete) > idx:
        try:
            group = int(concrete[idx])
        except (TypeError, ValueError):
            pass
    if numel is None or dtype is None or not group:
        return None
    kind, itemsize = KINDS[op], dtype[1]  # the input is one rank's shard of an all-gather: its payload is the output
    return kind.comm_bytes(numel * itemsize, kind.output_numel(numel, group) * itemsize), group


def _nccl_info(event: Mapping[str, Any]) -> tuple[CollectiveOp, int, int] | None:
    """(op, bytes, group size) straight from an NCCL kernel event's arguments, when the profiler put them."""
    args = event.get("args") or {}
    name = str(args.get("Collective name", "")).lower().replace("_", "")
    op = next((o for key, o in _NCCL_OPS.items() if key in name), None)
    size = _NCCL_DTYPES.get(str(args.get("dtype", "")))
    try:
        in_n, out_n, group = int(args["In msg nelems"]), int(args["Out msg nelems"]), int(args["Group size"])
    except (KeyError, TypeError, ValueError):
        return None
    if op is None or size is None or group < 1:
        return None
    return op, max(in_n, out_n) * size, group


def _device_collective(event: Mapping[str, Any]) -> CollectiveOp | None:
    name = str(event.get("name", ""))
    if name in _GLOO_OPS:
        return _GLOO_OPS[name]
    if event.get("cat") == "kernel" and name.lower().startswith("nccl"):
        lowered = name.lower().replace("_", "")
        return next((o for key, o in _NCCL_OPS.items() if key in lowered), CollectiveOp.OTHER)
    return None


def _collectives(events: Iterable[Mapping[str, Any]], world: int | None, cal: Calibration) -> int:
    issued: list[Mapping[str, Any]] = []
    ran: list[Mapping[str, Any]] = []
    for e in events:
        if e.get("name") in _ISSUE_OPS:
            issued.append(e)
        elif _device_collective(e) is not None:
            ran.append(e)
    issued.sort(key=lambda e: e["ts"])
    ran.sort(key=lambda e: e["ts"])
    paired = len(issued) == len(ran)
    count = 0
    for k, e in enumerate(ran):
        info = _nccl_info(e)
        if info is None and paired:
            op = _ISSUE_OPS[issued[k]["name"]]
            found = _issue_info(issued[k], op, world)
            info = (op, *found) if found is not None else None
        if info is None:
            continue
        op, nbytes, group = info
        if group > 1 and nbytes > 0 and e["dur"] > 0:
            cal.add_collective(op, group, nbytes, e["dur"] / 1e3)
            count += 1
    return count


def _outermost_extern(events: list[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """For every event inside an aten op that a compiled graph's wrapper calls itself (an extern kernel), that
    op, by the event's id (the op maps to itself): the op a device kernel launched from inside it belongs to."""
    out: dict[int, Mapping[str, Any]] = {}
    by_thread: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "kernel":
            by_thread[e.get("tid")].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[Mapping[str, Any], Mapping[str, Any] | None]] = []  # (event, its extern op)
        for e in thread:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                stack.pop()
            parent, root = stack[-1] if stack else (None, None)
            if root is None and parent is not None and str(parent.get("name", "")).startswith(_COMPILED_CALL) \
                    and str(e.get("name", "")).startswith("aten::"):
                root = e
            if root is not None:
                out[id(e)] = root
            stack.append((e, root))
    return out


def _extern_key(op: Mapping[str, Any]) -> str | None:
    shapes = _shapes(op.get("args") or {})
    name = str(op.get("name", ""))
    return f"aten.{name[len('aten::'):]} {shapes}" if shapes is not None else None


def _kernels(events: list[Mapping[str, Any]], cal: Calibration) -> int:
    """Generated kernels by name stem; extern kernels by their aten op and shapes: on a CPU trace the op's own
    time, on a device trace the summed time of the device kernels it launched (a cuBLAS GEMM, a split-K
    reduction), found through the profiler's ``External id`` that links a kernel to the op launching it."""
    on_device = [e for e in events if e.get("cat") == "kernel"]
    samples: dict[str, list[float]] = defaultdict(list)
    roots = _outermost_extern(events)
    if not on_device:
        for e in events:
            stem = kernel_stem(str(e.get("name", "")))
            if stem is not None:
                samples[stem].append(e["dur"] / 1e3)
            elif roots.get(id(e)) is e:
                key = _extern_key(e)
                if key is not None:
                    samples[key].append(e["dur"] / 1e3)
    else:
        op_of_id = {}
        for e in events:
            ext = (e.get("args") or {}).get("External id")
            if e.get("cat") != "kernel" and ext is not None and id(e) in roots:
                op_of_id[ext] = roots[id(e)]
        per_call: dict[int, list[Any]] = {}  # one extern call -> [key, summed device time]
        for e in on_device:
            stem = kernel_stem(str(e.get("name", "")))
            if stem is not None:
                samples[stem].append(e["dur"] / 1e3)
                continue
            if _device_collective(e) is not None:
                continue
            op = op_of_id.get((e.get("args") or {}).get("External id"))
            key = _extern_key(op) if op is not None else None
            if key is not None:
                per_call.setdefault(id(op), [key, 0.0])[1] += e["dur"] / 1e3
        for key, ms in per_call.values():
            samples[key].append(ms)
    for key, values in samples.items():
        cal.add_kernel(key, statistics.median(values), len(values))
    return len(samples)


def calibrate_from_trace(path: PathLike, base: Calibration | None = None) -> Calibration:
    """A calibration measured from a ``torch.profiler`` Chrome trace (see the module docstring).

    ``base``: a calibration to start from (e.g. a collective sweep); the trace's measurements are added to
    it (collective points are averaged with its points at equal sizes, kernel times replace its entries).
    A missing or malformed file is a ValueError naming it; a trace without any kernel or collective the
    reader knows is a ValueError too (``enable_kernel_profile`` / ``record_shapes`` were probably off).
    """
    events, world = _load_events(path)
    cal = Calibration(meta={"source": "trace", "trace": os.path.basename(os.fspath(path))})
    by_process: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    if any(e.get("cat") == "kernel" for e in events):
        # a device trace is one process's: its kernels sit under the device's pid, the ops launching them
        # under the host process's, and are read together
        by_process[None] = events
    else:
        for e in events:
            by_process[e.get("pid")].append(e)
    n_coll = n_kern = 0
    for process_events in by_process.values():
        n_coll += _collectives(process_events, world, cal)
        n_kern += _kernels(process_events, cal)
    if not n_coll and not n_kern:
        raise ValueError(
            f"trace file {os.fspath(path)}: no compiled kernel or collective found (profile with record_shapes=True, "
            "and on CPU set torch._inductor.config.cpp.enable_kernel_profile = True before compiling)"
        )
    cal.meta.update({"collectives_measured": n_coll, "kernels_measured": n_kern})
    if base is not None:
        merged = Calibration()
        merged.update(base)
        merged.update(cal)
        return merged
    return cal
