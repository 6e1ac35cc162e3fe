"""A small Qwen3 decoder with random weights built from a config (nothing downloaded)."""

from __future__ import annotations

import torch

from kvstore import KVLayout, Namespace


def tiny_qwen3(seed: int = 0, layers: int = 3):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval().to(torch.float32)
    return model, config


def namespace_for(config, revision: str = "seed0") -> Namespace:  # type: ignore[no-untyped-def]
    layout = KVLayout.from_hf_config(config, dtype=torch.float32, page_tokens=16)
    return Namespace(model="tiny-qwen3", revision=revision, layout=layout)


def greedy(model, ids: torch.Tensor, past=None, steps: int = 32) -> list[int]:  # type: ignore[no-untyped-def]
    out = model.generate(ids, past_key_values=past, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, ids.shape[1]:].tolist()
