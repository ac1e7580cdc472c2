"""Real model shapes for `random:SHAPE` benchmarks: the published config.json of each model.

The dicts are the hub config.json files (meta-llama/*, Qwen/*; Qwen3-30B-A3B for mixture of experts) with their numerics-relevant keys
as published: hidden/intermediate sizes, heads, KV heads, head_dim, layers, vocab, rope (theta
and llama3 scaling), norm eps, tied embeddings. Random weights of these shapes run the same
kernels at the same sizes as the real models, which is what a speed benchmark needs.

`scale_down(cfg, f)` shrinks a shape by `f` while keeping its structure (GQA, head_dim, rope,
tying): a test hook that exercises the random path end to end on a small CPU.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

from mlxbun.errors import ConfigError, MlxbunError

__all__ = ["SHAPES", "load_shape", "scale_down", "shape_config"]

_LLAMA3_ROPE_1B_3B = {  # Llama 3.2 1B / 3B
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA31_ROPE = {  # Llama 3.1 8B / 70B
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _llama(**kw) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mlp_bias": False,
        "model_type": "llama",
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    }
    base.update(kw)
    return base


def _qwen3(**kw) -> dict:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 40960,
        "model_type": "qwen3",
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    base.update(kw)
    return base


def _gpt_oss(**kw) -> dict:
    base = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_experts_per_tok": 4,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    }
    base.update(kw)
    return base


SHAPES: Mapping[str, dict] = {
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": _llama(
        head_dim=64, hidden_size=2048, intermediate_size=8192, max_position_embeddings=131072,
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
        rope_scaling=_LLAMA3_ROPE_1B_3B, tie_word_embeddings=True,
    ),
    # meta-llama/Llama-3.2-3B
    "llama-3.2-3b": _llama(
        head_dim=128, hidden_size=3072, intermediate_size=8192, max_position_embeddings=131072,
        num_attention_heads=24, num_hidden_layers=28, num_key_value_heads=8,
        rope_scaling=_LLAMA3_ROPE_1B_3B, tie_word_embeddings=True,
    ),
    # meta-llama/Meta-Llama-3-8B (no rope scaling: that came with 3.1)
    "llama-3-8b": _llama(
        hidden_size=4096, intermediate_size=14336, max_position_embeddings=8192,
        num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
        rope_scaling=None, tie_word_embeddings=False,
    ),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": _llama(
        hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072,
        num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
        rope_scaling=_LLAMA31_ROPE, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": _qwen3(
        hidden_size=1024, intermediate_size=3072, max_window_layers=28, num_attention_heads=16,
        num_hidden_layers=28, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": _qwen3(
        hidden_size=2048, intermediate_size=6144, max_window_layers=28, num_attention_heads=16,
        num_hidden_layers=28, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-4B
    "qwen3-4b": _qwen3(
        hidden_size=2560, intermediate_size=9728, max_window_layers=36, num_attention_heads=32,
        num_hidden_layers=36, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": _qwen3(
        hidden_size=4096, intermediate_size=12288, max_window_layers=36, num_attention_heads=32,
        num_hidden_layers=36, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts, 8 routed per token, every layer MoE
    "qwen3-30b-a3b": _qwen3(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_window_layers=48,
        num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, output_router_logits=False,
        router_aux_loss_coef=0.001, tie_word_embeddings=False,
    ),
    # openai/gpt-oss-20b (its quantization_config, mxfp4 experts, left out: --quant quantizes)
    "gpt-oss-20b": _gpt_oss(
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        num_hidden_layers=24, num_local_experts=32,
        layer_types=["sliding_attention", "full_attention"] * 12,
    ),
}


def shape_config(name: str) -> dict:
    """A fresh copy of a named shape's config.json dict."""
    key = name.lower()
    if key not in SHAPES:
        raise MlxbunError(f"random:{name}: unknown shape; known: {', '.join(SHAPES)} "
                          "(or random:PATH to a config.json)")
    return copy.deepcopy(SHAPES[key])


def load_shape(spec: str) -> tuple[str, dict]:
    """(label, config) for the SHAPE of `random:SHAPE`: a named shape or a config.json path."""
    if spec.lower() in SHAPES:
        return spec.lower(), shape_config(spec)
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        # Neither a name nor a file: the name list is the useful message.
        return spec, shape_config(spec)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read a config.json ({e})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ConfigError(f"{p}: not a model config (a JSON object with a 'model_type' string)")
    for key in ("quantization", "quantization_config"):  # random weights are quantized by --quant only
        cfg.pop(key, None)
    return str(p), cfg


def _int(cfg: Mapping[str, Any], key: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"shape: '{key}' must be a positive int to scale down, got {v!r}")
    return v


def scale_down(cfg: Mapping[str, Any], factor: int) -> dict:
    """The shape shrunk by `factor`: hidden, intermediate, heads, KV heads, layers and vocab
    divided (heads >= 1, layers >= 2), head_dim, GQA grouping, rope and tying kept; a mixture of
    experts also gets narrower experts and fewer of them (at least top-k)."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise MlxbunError(f"scale-down factor must be an int >= 1, got {factor!r}")
    out = copy.deepcopy(dict(cfg))
    if factor == 1:
        return out
    heads = _int(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size") // heads
    new_heads = max(1, heads // factor)
    new_kv = max(1, min(new_heads, kv // factor))
    while new_heads % new_kv:  # keep a whole number of query heads per KV head
        new_kv -= 1
    out.update(
        hidden_size=max(8, _int(cfg, "hidden_size") // factor),
        intermediate_size=max(8, _int(cfg, "intermediate_size") // factor),
        num_attention_heads=new_heads,
        num_key_value_heads=new_kv,
        head_dim=head_dim,
        num_hidden_layers=max(2, _int(cfg, "num_hidden_layers") // factor),
        vocab_size=max(64, _int(cfg, "vocab_size") // factor),
    )
    if isinstance(out.get("layer_types"), list):  # the per-layer pattern (gpt_oss), cut to the new depth
        out["layer_types"] = out["layer_types"][:out["num_hidden_layers"]]
    if "max_window_layers" in out:
        out["max_window_layers"] = out["num_hidden_layers"]
    if "moe_intermediate_size" in cfg:
        out["moe_intermediate_size"] = max(8, _int(cfg, "moe_intermediate_size") // factor)
    if "num_experts" in cfg:
        top_k = _int(cfg, "num_experts_per_tok")
        out["num_experts"] = max(top_k, _int(cfg, "num_experts") // factor)
    return out
