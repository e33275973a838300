"""What ``enable(check_ranks=True)`` costs: at compile time (building the graph's collective sequences and
inserting the check's call, per graph) and per step (the call of a graph already checked).

    python benchmarks/check_ranks_cost.py [--layers 8] [--calls 20000]

Compiles the built-in Llama sharded by ``data_parallel`` on a one-rank gloo group in this process (real
collectives, nothing sent) with the passes' defaults; times ``insert_rank_check`` inside the compile and a
whole first step with and without the check, then the check's op alone on a sequence that already passed.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()

    import torch
    import torch._dynamo
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    import fsdp_passes
    from fsdp_passes.inductor import passes, rank_check
    from fsdp_passes.testing import build_llama, example_inputs

    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    insert_times: list[float] = []
    original = rank_check.insert_rank_check

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            insert_times.append(time.perf_counter() - start)

    passes.insert_rank_check = timed
    out = {"layers": args.layers}
    for check in (False, True):
        torch._dynamo.reset()
        model = build_llama(n_layers=args.layers, dim=128, ffn_dim=256)
        inputs = example_inputs(model, batch=2)
        with fsdp_passes.enabled(check_ranks=check):
            compiled = torch.compile(model)
            start = time.perf_counter()
            compiled(*inputs).sum().backward()
            out[f"first_step_s_check_{check}"] = round(time.perf_counter() - start, 2)
    out["insert_rank_check_ms_per_graph"] = [round(t * 1e3, 2) for t in insert_times]
    op = rank_check.CHECK_OP
    sequences = json.dumps({"0": ["all_gather 0 1024 float32"] * 64})
    op("bench", sequences, -1.0)  # passes (one rank), then every call is the per-step path
    start = time.perf_counter()
    for _ in range(args.calls):
        op("bench", sequences, -1.0)
    out["per_call_us"] = round((time.perf_counter() - start) / args.calls * 1e6, 2)
    dist.destroy_process_group()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
