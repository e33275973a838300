"""Third-party models for the test tier: small random configurations, no downloads.

* Hugging Face transformers GPT-2 and Qwen2 causal LMs, sharded by torchtitan's SimpleFSDP ``data_parallel``
  (parameters become ``Shard(0)`` DTensors read through a property whose getter all-gathers them; no FQN
  annotations), inside a loss module (so FQNs start with ``lm.``);
* torchtitan's Qwen3 debug model (its first layers, SDPA attention), through the same frontend.

Two blocks (layers) by default; the per-block plans and block names below are for two.  Vocabulary sizes that do not divide by the group size (251) give uneven shards.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn as nn

MODELS = ("gpt2", "qwen2", "qwen3")

#: manual per-block plans, in each model's own FQNs (the loss module is what gets compiled)
PER_BLOCK_PLANS = {
    "gpt2": ["lm.transformer.wte", "lm.transformer.wpe", "lm.transformer.h.[0-1]", ["lm.transformer.ln_f", "lm.lm_head"]],
    "qwen2": ["lm.model.embed_tokens", "lm.model.layers.[0-1]", ["lm.model.norm", "lm.lm_head"]],
    "qwen3": ["lm.tok_embeddings", "lm.layers.[0-1]", ["lm.norm", "lm.lm_head"]],
}
BLOCKS = {
    "gpt2": ["lm.transformer.h.0", "lm.transformer.h.1"],
    "qwen2": ["lm.model.layers.0", "lm.model.layers.1"],
    "qwen3": ["lm.layers.0", "lm.layers.1"],
}
VOCAB = {"gpt2": 251, "qwen2": 251, "qwen3": 2048}


class LossOf(nn.Module):
    """Cross-entropy of a causal LM's logits against its inputs (a wrapper around the model)."""

    def __init__(self, lm: nn.Module, hf: bool) -> None:
        super().__init__()
        self.lm = lm
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits if self.hf else self.lm(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def _without_triton_ep_kernels() -> None:
    """torchtitan's model package imports its MinimalAsyncEP token dispatcher, whose module imports triton
    kernels at import time.  A dense model never dispatches tokens: register placeholders for that one
    module (they raise if called) so the models import on a CPU-only install without triton."""
    name = "torchtitan.distributed.minimal_async_ep"
    if name in sys.modules:
        return
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    module = types.ModuleType(name)

    def unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torchtitan's MinimalAsyncEP needs triton")

    for attr in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config"):
        setattr(module, attr, unavailable)
    module.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})
    sys.modules[name] = module


def build_lm(name: str, seed: int = 0, n_layers: int = 2) -> tuple[nn.Module, bool]:
    """The unsharded model (random weights from ``seed``, ``n_layers`` blocks) and whether it is a transformers
    model."""
    torch.manual_seed(seed)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB[name], n_positions=32, n_embd=64, n_layer=n_layers, n_head=4,
                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), True
    if name == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(vocab_size=VOCAB[name], hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          bos_token_id=0, eos_token_id=0)
        return Qwen2ForCausalLM(cfg), True
    if name == "qwen3":
        _without_triton_ep_kernels()
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.qwen3 import qwen3_configs

        cfg = qwen3_configs["debugmodel"](attn_backend="flex")
        cfg.layers = cfg.layers[:n_layers]
        for layer in cfg.layers:  # causal SDPA: flex attention's block masks need more than a CPU compile
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        model = cfg.build()
        with torch.no_grad():
            model.init_states()
        return model, False
    raise ValueError(f"model {name!r}: expected one of {MODELS}")


def sharded_loss_module(name: str, world_size: int, seed: int = 0, n_layers: int = 2) -> LossOf:
    """``LossOf`` around the model sharded over the default process group by torchtitan's ``data_parallel``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    lm, hf = build_lm(name, seed, n_layers)
    mesh = init_device_mesh("cpu", (world_size,))
    return LossOf(data_parallel(lm, mesh, mode="fully_shard"), hf)


def token_ids(name: str, seed: int = 1, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB[name], (batch, seq), generator=g)
