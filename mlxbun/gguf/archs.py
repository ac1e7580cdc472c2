"""Per GGUF architecture: the Hugging Face config.json, where each tensor goes, and what
llama.cpp's converter changed on the way in (undone here).

    arch_for(meta)                 the `Arch` row of general.architecture, or a GGUFError naming it
    arch.config(meta, tensors)     config.json (Hugging Face keys, as mlx-lm 0.32.2 reads them)
    hf_name(arch, name, layers)    "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"
    undo_converter(...)            llama / mistral: Q and K rows back from llama.cpp's rope layout;
                                   gemma3: the +1 llama.cpp adds to every RMSNorm weight

What GGUF does not record: Gemma-3's local rope base (10000) and its 5-local:1-global pattern
are transformers' / mlx-lm's gemma3_text defaults; its query_pre_attn_scalar follows llama.cpp
(head_dim, but hidden / heads for the 62-layer 27B). Mistral GGUFs are arch "llama" (llama.cpp
converts MistralForCausalLM as llama; mlx-lm runs mistral as llama), imported as model_type llama.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mlxbun.gguf.blocks import Packed
from mlxbun.gguf.reader import GGUFError, Metadata

__all__ = ["ARCHS", "Arch", "arch_for", "hf_name", "undo_converter"]

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3_BLOCK = {**_LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_BLOCK = {
    **_QWEN3_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # gate and up fused, as Phi-3 stores them
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _f(x) -> float:
    """A float32 as its shortest decimal (the same float32 back)."""
    return float(str(np.float32(x)))


# ------------------------------------------------------------------ config pieces


def _base(meta: Metadata, a: str, tensors: Mapping, model_type: str, architecture: str) -> dict:
    if meta.opt(f"{a}.expert_count", int, 0):
        raise GGUFError(f"{meta.path}: a mixture-of-experts {a} model ({a}.expert_count = "
                        f"{meta[f'{a}.expert_count']}); mlxbun imports dense models only")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{meta.path}: no tensor 'token_embd.weight' (the token embedding)")
    heads = meta.need(f"{a}.attention.head_count", int, "number of attention heads; one per layer is not supported")
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": meta.need(f"{a}.embedding_length"),
        "num_hidden_layers": meta.need(f"{a}.block_count"),
        "intermediate_size": meta.need(f"{a}.feed_forward_length", int, "one per layer is not supported"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.opt(f"{a}.attention.head_count_kv", int, heads),
        "rms_norm_eps": meta.need(f"{a}.attention.layer_norm_rms_epsilon", float),
        "max_position_embeddings": meta.need(f"{a}.context_length"),
        "rope_theta": meta.opt(f"{a}.rope.freq_base", float, 10000.0),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGML order: (hidden, vocab)
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for key in ("bos", "eos", "padding"):
        token = meta.opt(f"tokenizer.ggml.{key}_token_id", int)
        if token is not None:
            cfg[f"{'pad' if key == 'padding' else key}_token_id"] = token
    return cfg


def _head_dim(meta: Metadata, a: str, cfg: dict) -> int:
    return meta.opt(f"{a}.attention.key_length", int, cfg["hidden_size"] // cfg["num_attention_heads"])


def _rope_scaling(meta: Metadata, a: str, tensors: Mapping, cfg: dict) -> Optional[dict]:
    """rope_scaling from `{arch}.rope.scaling.*`, or Llama 3's from the `rope_freqs` tensor."""
    if "rope_freqs.weight" in tensors:
        return _llama3_rope(meta, tensors["rope_freqs.weight"], cfg)
    kind = meta.opt(f"{a}.rope.scaling.type", str)
    if kind in (None, "none"):
        return None
    factor = meta.need(f"{a}.rope.scaling.factor", float, f"rope scaling {kind}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
               meta.need(f"{a}.rope.scaling.original_context_length", int, "yarn rope scaling")}
        for key in ("beta_fast", "beta_slow"):
            if (v := meta.opt(f"{a}.rope.scaling.yarn_{key}", float)) is not None:
                out[key] = v
        return out
    raise GGUFError(f"{meta.path}: rope scaling type {kind!r} is not importable (linear, yarn, llama3 are)")


def _llama3_factors(params: dict, head_dim: int, base: float) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter writes as `rope_freqs` for llama3 rope."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old, low, high, factor = (params["original_max_position_embeddings"], params["low_freq_factor"],
                              params["high_freq_factor"], params["factor"])
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _llama3_rope(meta: Metadata, tensor, cfg: dict) -> dict:
    """GGUF keeps only the factors; Meta's Llama 3.x used low 1 / high 4 and an original
    context of 8192: take the factor as their maximum and keep the parameters only when they
    reproduce every factor the file holds."""
    got = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    factor = _f(got.max())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for old in dict.fromkeys((8192, int(round(cfg["max_position_embeddings"] / factor)))):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": old}
        want = _llama3_factors(params, head_dim, cfg["rope_theta"])
        if want.shape == got.shape and np.allclose(want, got, rtol=1e-5, atol=0):
            return params
    raise GGUFError(f"{meta.path}: tensor 'rope_freqs.weight' holds rope factors that no llama3 rope "
                    "scaling (low 1, high 4) reproduces; not importable")


# ------------------------------------------------------------------ per arch


def _llama(meta: Metadata, tensors: Mapping) -> dict:
    cfg = _base(meta, "llama", tensors, "llama", "LlamaForCausalLM")
    head_dim = _head_dim(meta, "llama", cfg)
    rope_dims = meta.opt("llama.rope.dimension_count", int, head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{meta.path}: llama with partial rope ({rope_dims} of {head_dim} head dims) "
                        "has no Hugging Face llama config")
    cfg["head_dim"] = head_dim
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    cfg["rope_scaling"] = _rope_scaling(meta, "llama", tensors, cfg)
    return cfg


def _qwen2(meta: Metadata, tensors: Mapping) -> dict:
    cfg = _base(meta, "qwen2", tensors, "qwen2", "Qwen2ForCausalLM")
    cfg["rope_scaling"] = _rope_scaling(meta, "qwen2", tensors, cfg)
    return cfg


def _qwen3(meta: Metadata, tensors: Mapping) -> dict:
    cfg = _base(meta, "qwen3", tensors, "qwen3", "Qwen3ForCausalLM")
    cfg["head_dim"] = _head_dim(meta, "qwen3", cfg)
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    cfg["rope_scaling"] = _rope_scaling(meta, "qwen3", tensors, cfg)
    return cfg


def _gemma3(meta: Metadata, tensors: Mapping) -> dict:
    a = "gemma3"
    cfg = _base(meta, a, tensors, "gemma3_text", "Gemma3ForCausalLM")
    head_dim = meta.need(f"{a}.attention.key_length", int, "Gemma-3's head_dim")
    layers = cfg["num_hidden_layers"]
    pattern = _swa_pattern(meta, f"{a}.attention.sliding_window_pattern", layers)
    del cfg["hidden_act"]
    cfg.update({
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp: 1/sqrt(hidden / heads) for the 62-layer 27B, else 1/sqrt(head_dim)
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62 else head_dim,
        "sliding_window": meta.need(f"{a}.attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": meta.opt(f"{a}.rope.freq_base_swa", float, 10000.0),
        "rope_scaling": _rope_scaling(meta, a, tensors, cfg),
    })
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if (v := meta.opt(f"{a}.{key}", float)) is not None:
            cfg[key] = v
    return cfg


def _swa_pattern(meta: Metadata, key: str, layers: int) -> int:
    """Every how many layers one is global: llama.cpp's key when the file has it (an int, or one
    bool per layer, True = sliding), else Gemma-3's 6 (5 local : 1 global)."""
    value = meta.get(key)
    if value is None:
        return 6
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, list) and len(value) == layers and all(isinstance(b, bool) for b in value):
        pattern = value.index(False) + 1 if False in value else layers + 1
        if value == [(i + 1) % pattern != 0 for i in range(layers)]:
            return pattern
    raise GGUFError(f"{meta.path}: {key} = {value!r:.80} is not one global layer every N "
                    "(the only layer pattern mlx-lm's gemma3_text runs)")


def _phi3(meta: Metadata, tensors: Mapping) -> dict:
    a = "phi3"
    cfg = _base(meta, a, tensors, "phi3", "Phi3ForCausalLM")
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_dims = meta.opt(f"{a}.rope.dimension_count", int, head_dim)
    if rope_dims != head_dim:
        cfg["partial_rotary_factor"] = rope_dims / head_dim
    if "rope_factors_long.weight" in tensors:
        def factors(name):
            return [_f(x) for x in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)]

        cfg["rope_scaling"] = {"type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                               "short_factor": factors("rope_factors_short.weight")}
        cfg["original_max_position_embeddings"] = meta.need(
            f"{a}.rope.scaling.original_context_length", int, "longrope scaling")
    else:
        cfg["rope_scaling"] = _rope_scaling(meta, a, tensors, cfg)
    return cfg


@dataclass(frozen=True)
class Arch:
    gguf: str  # general.architecture
    block: Mapping[str, str]  # GGUF block tensor stem -> Hugging Face module under model.layers.N
    config: Callable[[Metadata, Mapping], dict]
    qk_permuted: bool = False  # llama.cpp's converter permuted Q/K rows for its rope layout
    norm_plus_one: bool = False  # llama.cpp's converter added 1 to every RMSNorm weight
    into_config: frozenset = frozenset()  # tensors read into config.json, not the weights


ARCHS: dict[str, Arch] = {a.gguf: a for a in (
    Arch("llama", _LLAMA_BLOCK, _llama, qk_permuted=True, into_config=frozenset({"rope_freqs.weight"})),
    Arch("qwen2", _LLAMA_BLOCK, _qwen2),
    Arch("qwen3", _QWEN3_BLOCK, _qwen3),
    Arch("gemma3", _GEMMA3_BLOCK, _gemma3, norm_plus_one=True),
    Arch("phi3", _PHI3_BLOCK, _phi3,
         into_config=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})),
)}


def arch_for(meta: Metadata) -> Arch:
    name = meta.need("general.architecture", str, "the model's architecture")
    if name not in ARCHS:
        raise GGUFError(f"{meta.path}: GGUF architecture {name!r} is not importable "
                        f"(mlxbun imports {', '.join(sorted(ARCHS))}; mistral GGUFs are 'llama')")
    return ARCHS[name]


_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(arch: Arch, name: str, layers: int) -> Optional[str]:
    """The Hugging Face tensor name of GGUF tensor `name`, or None when it has no place."""
    if m := _BLOCK_RE.fullmatch(name):
        stem = arch.block.get(m[2])
        if stem is None or int(m[1]) >= layers:
            return None
        return f"model.layers.{int(m[1])}.{stem}.{m[3]}"
    if (m := _GLOBAL_RE.fullmatch(name)) and m[1] in _GLOBAL:
        return f"{_GLOBAL[m[1]]}.{m[2]}"
    return None


def _unpermute_index(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's `permute(w, n_head)`: its row (h, i, j) of shape
    (n_head, head_dim/2, 2) holds the Hugging Face row (h, j, i)."""
    return np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(-1).argsort()


def undo_converter(arch: Arch, name: str, value: Any, cfg: Mapping) -> Any:
    """`value` (float array or Packed) of GGUF tensor `name` as the Hugging Face tensor."""
    stem = name.split(".")[-2] if name.startswith("blk.") else None
    if arch.qk_permuted and stem in ("attn_q", "attn_k"):
        n_head = cfg["num_attention_heads"] if stem == "attn_q" else cfg["num_key_value_heads"]
        rows = value.rows if isinstance(value, Packed) else value.shape[0]
        index = _unpermute_index(rows, n_head)
        return value.take_rows(index) if isinstance(value, Packed) else value[index]
    if arch.norm_plus_one and name.endswith("norm.weight"):
        if isinstance(value, Packed):
            raise GGUFError(f"norm tensor {name!r} is quantized")
        return value - np.float32(1.0)
    return value
