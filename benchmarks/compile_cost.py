"""What the passes cost a user's whole compile: the first training step's wall time with the passes off and on.

Each measurement is a fresh Python process (``--child``) that builds a model sharded by
``fsdp_passes.testing.simple_fsdp`` on a fake process group (world size 8, rank 0), compiles it
(``torch.compile(fullgraph=True)``) and times its first step, forward and backward, from the first call to the
end of ``backward()``: Dynamo, AOTAutograd, Inductor's lowering and code generation, the C++ compiler and
the step itself.  Nothing is warm: the FX graph cache and the AOTAutograd cache are off, and each process gets
an empty ``TORCHINDUCTOR_CACHE_DIR`` (so every C++ kernel is compiled).  Modes: ``off`` (no passes), ``on``
(``fsdp_passes.enable()`` defaults: auto bucketing, reordering), ``noreorder`` (``enable(reorder=False)``).
The modes alternate within each round (the order rotates from one round to the next) so that a change in the
machine's load falls on all of them.  Reported per run: wall time, Inductor's generated kernel count
(``torch._inductor.metrics.generated_kernel_count``), the C++ kernel libraries compiled (``.so`` files in the
fresh cache folder: distinct kernel sources), the passes' own time (their reports' ``pass_time_s``), merged
buckets, and the load average before and after.

Models: ``llama`` (``fsdp_passes.testing.build_llama``) and Hugging Face transformers ``mistral``, ``gpt2``,
``qwen2`` causal LMs in small random configurations (nothing downloaded), each inside a cross-entropy loss.

    python benchmarks/compile_cost.py                                   # all models, 2 layers, 3 rounds
    python benchmarks/compile_cost.py --models mistral --layers 8 --rounds 2 --modes off,on,noreorder
    python benchmarks/compile_cost.py --smoke                           # the Llama, 1 layer, 1 round (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

MODELS = ("llama", "mistral", "gpt2", "qwen2")
MODES = ("off", "on", "noreorder")
VOCAB = 251  # does not divide by the world size: uneven shards, padded by the frontend


# --------------------------------------------------------------------------------------------------
# Child: one compile in a fresh process
# --------------------------------------------------------------------------------------------------

def _transformers_lm(name: str, layers: int) -> Any:
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    if name == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=32, **common))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_positions=32, n_embd=64, n_layer=layers, n_head=4, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, **common))
    if name == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32, **common))
    raise ValueError(f"--models: {name!r} is not one of {MODELS}")


def _model_and_input(name: str, layers: int) -> tuple[Any, Any]:
    import torch
    import torch.nn as nn

    from fsdp_passes.testing import build_llama, example_inputs, simple_fsdp

    torch.manual_seed(0)
    if name == "llama":
        model = build_llama(n_layers=layers)
        ids = example_inputs(model)[0]

        class Loss(nn.Module):
            def __init__(self, lm: nn.Module) -> None:
                super().__init__()
                self.lm = lm

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.lm(ids).float().logsumexp(-1).mean()

        return Loss(model), ids

    class CausalLoss(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            logits = self.lm(input_ids=ids).logits
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    lm = simple_fsdp(_transformers_lm(name, layers))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    return CausalLoss(lm), ids


def child(model: str, mode: str, layers: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    import fsdp_passes
    from fsdp_passes.testing import fake_process_group

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    with fake_process_group(world_size=world_size), C.quiet_warnings():
        module, ids = _model_and_input(model, layers)
        if mode == "on":
            fsdp_passes.enable()
        elif mode == "noreorder":
            fsdp_passes.enable(reorder=False)
        compiled = torch.compile(module, fullgraph=True)
        metrics.reset()
        start = time.perf_counter()
        compiled(ids).backward()
        wall = time.perf_counter() - start
        reports = fsdp_passes.last_reports(clear=True)
        fsdp_passes.disable()
    # one merged collective per multi-member bucket
    buckets = sum(len(r.extra.get("bucketing", {}).get("collectives", [])) for r in reports if r.pass_name == "fx")
    return {"wall_s": wall, "kernels": metrics.generated_kernel_count,
            "pass_s": sum(r.pass_time_s for r in reports), "merged_buckets": buckets,
            "collectives": [(r.graph, r.n_collectives_before, r.n_collectives_after) for r in reports
                            if r.pass_name == "fx"]}


# --------------------------------------------------------------------------------------------------
# Parent: alternate modes, one fresh process and cache folder per measurement
# --------------------------------------------------------------------------------------------------

def measure(model: str, mode: str, layers: int, world_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="compile_cost_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(C.REPO))
        load_before = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, __file__, "--child", model, mode, str(layers), str(world_size)],
                              env=env, capture_output=True, text=True, cwd=str(C.REPO))
        if proc.returncode != 0:
            raise RuntimeError(f"{model} {mode}: child failed:\n{proc.stderr[-4000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        out["cpp_libraries"] = sum(1 for _ in Path(cache).rglob("*.so"))
    out.update(model=model, mode=mode, load_before=load_before, load_after=os.getloadavg()[0])
    return out


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {m: [r for r in runs if r["mode"] == m] for m in modes}
    out: dict[str, Any] = {}
    for m, rs in by.items():
        out[m] = {"wall_s": C.spread([r["wall_s"] for r in rs]),
                  "kernels": statistics.median(r["kernels"] for r in rs),
                  "cpp_libraries": statistics.median(r["cpp_libraries"] for r in rs),
                  "pass_s": statistics.median(r["pass_s"] for r in rs),
                  "merged_buckets": statistics.median(r["merged_buckets"] for r in rs)}
    off = out["off"]["wall_s"]["median"]
    for m in modes:
        if m != "off":
            out[m]["ratio_to_off"] = out[m]["wall_s"]["median"] / off
            # per round: this mode's run over the off run of the same round
            rounds = zip([r for r in runs if r["mode"] == m], [r for r in runs if r["mode"] == "off"])
            out[m]["ratio_per_round"] = [a["wall_s"] / b["wall_s"] for a, b in rounds]
            out[m]["extra_kernels_per_bucket"] = (
                (out[m]["kernels"] - out["off"]["kernels"]) / out[m]["merged_buckets"]
                if out[m]["merged_buckets"] else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--out", default=str(C.RESULTS_DIR / "compile_cost.json"))
    ap.add_argument("--smoke", action="store_true", help="the Llama, 1 layer, 1 round (CI)")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "MODE", "LAYERS", "WORLD"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        model, mode, layers, world = a.child
        print(json.dumps(child(model, mode, int(layers), int(world))))
        return
    if a.smoke:
        a.models, a.layers, a.rounds = "llama", 1, 1
    models = a.models.split(",")
    modes = a.modes.split(",")
    for m in models:
        if m not in MODELS:
            raise ValueError(f"--models: {m!r} is not one of {MODELS}")
    if "off" not in modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes: {a.modes!r}: a comma-separated subset of {MODES} that includes 'off'")
    if a.layers < 1 or a.rounds < 1:
        raise ValueError("--layers and --rounds must be at least 1")

    result: dict[str, Any] = {"machine": C.machine(), "layers": a.layers, "rounds": a.rounds,
                              "world_size": a.world_size, "models": {}}
    for model in models:
        runs = []
        for k in range(a.rounds):
            order = modes[k % len(modes):] + modes[:k % len(modes)]
            for mode in order:
                r = measure(model, mode, a.layers, a.world_size)
                runs.append(r)
                print(f"{model:8s} round {k} {mode:9s} {r['wall_s']:6.1f} s  kernels {r['kernels']:4d}  "
                      f"C++ libraries {r['cpp_libraries']:3d}  passes {r['pass_s']:.2f} s  "
                      f"load {r['load_before']:.1f}->{r['load_after']:.1f}", flush=True)
        result["models"][model] = {"runs": runs, "summary": summarize(runs, modes)}
        C.write_json(Path(a.out), result)

    rows = []
    for model, res in result["models"].items():
        s = res["summary"]
        for m in modes:
            if m == "off":
                continue
            rows.append([model, m, f"{s['off']['wall_s']['median']:.1f}", f"{s[m]['wall_s']['median']:.1f}",
                         f"{s[m]['ratio_to_off']:.2f}",
                         " ".join(f"{x:.2f}" for x in s[m]["ratio_per_round"]),
                         f"{s['off']['kernels']:.0f} / {s[m]['kernels']:.0f}",
                         f"{s['off']['cpp_libraries']:.0f} / {s[m]['cpp_libraries']:.0f}",
                         f"{s[m]['merged_buckets']:.0f}", f"{s[m]['pass_s']:.2f}"])
    print(C.fmt_table(["model", "mode", "off s", "mode s", "ratio", "per round", "kernels off/mode",
                       "C++ libs off/mode", "buckets", "passes s"], rows))
    print(f"results: {a.out}")


if __name__ == "__main__":
    main()
