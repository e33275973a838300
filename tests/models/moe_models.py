"""Mixture-of-experts models from transformers for the test tier: Mixtral (8 experts, top-2) and Qwen2-MoE
(8 experts, top-2, a shared expert), small random configurations, no downloads.  The experts run as
transformers' default ``grouped_mm`` kernel or its ``eager`` loop over experts (data-dependent token
routing: graph breaks)."""

from __future__ import annotations

import torch
import torch.nn as nn

from third_party_models import LossOf  # the same causal-LM loss wrapper as the dense tier

MOE_MODELS = ("mixtral", "qwen2_moe")
VOCAB = 256


def build_moe(name: str, experts: str = "grouped_mm", n_layers: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0,
                  eos_token_id=0)
    if name == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(intermediate_size=128, num_local_experts=8, **common)
        cls = MixtralForCausalLM
    elif name == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                             num_experts=8, **common)
        cls = Qwen2MoeForCausalLM
    else:
        raise ValueError(f"model {name!r}: expected one of {MOE_MODELS}")
    cfg._experts_implementation = experts
    return cls(cfg)


def sharded_moe_loss(name: str, world_size: int, experts: str = "grouped_mm", n_layers: int = 2,
                     seed: int = 0) -> LossOf:
    """``LossOf`` around the model sharded by ``fsdp_passes.data_parallel`` over the default group."""
    import fsdp_passes
    from torch.distributed.device_mesh import init_device_mesh

    lm = build_moe(name, experts, n_layers, seed)
    return LossOf(fsdp_passes.data_parallel(lm, init_device_mesh("cpu", (world_size,))), hf=True)


def per_block_plan(n_layers: int = 2) -> list:
    return ["lm.model.embed_tokens", f"lm.model.layers.[0-{n_layers - 1}]", ["lm.model.norm", "lm.lm_head"]]


def token_ids(seed: int = 1, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
