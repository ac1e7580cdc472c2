"""A Hugging Face checkpoint written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes it,
for the import round trip (tests/test_gguf_import.py) on the zoo's tiny checkpoints.

Independent of mlxbun.gguf where it can be: tensor names come from llama.cpp's own table
(`gguf.get_tensor_name_map`), metadata keys from `gguf.Keys`, quantization from `gguf.quants`.
What the converter changes is redone here as it does it: llama's Q/K rows permuted for its rope
layout (`LlamaModel.permute`), llama3 rope written as the `rope_freqs` factors, Gemma's RMSNorm
weights stored +1, Phi-3's longrope factors as tensors. Also the bad files of the error tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma3_text": "gemma3", "phi3": "phi3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(rope: dict, head_dim: int, base: float) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' rope_freqs (convert_hf_to_gguf.py)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokenizer(w, ckpt: Path) -> None:
    """The zoo's byte-level BPE as llama.cpp's gpt2 tokenizer metadata."""
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    w.add_array("tokenizer.ggml.merges", merges)
    cfg = json.loads((ckpt / "config.json").read_text())
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    w.add_uint32("tokenizer.ggml.padding_token_id", cfg["pad_token_id"])
    w.add_bool("tokenizer.ggml.add_bos_token", False)


def export_gguf(ckpt: Path, out: Path, *, qtype: str = "F32", skip_tensors=(), skip_keys=(),
                arch_name: str | None = None) -> Path:
    """Write zoo checkpoint `ckpt` (float32) as GGUF file `out`: 2-D weights as `qtype`
    (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q6_K...), everything else F32."""
    import gguf
    import mlx.core as mx
    from gguf import GGMLQuantizationType as T
    from gguf import Keys

    cfg = json.loads((ckpt / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    header_arch = arch_name or arch  # another name: a file whose architecture mlxbun does not know
    n_layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), header_arch)
    keys = {
        Keys.LLM.BLOCK_COUNT: ("uint32", n_layers),
        Keys.LLM.CONTEXT_LENGTH: ("uint32", cfg["max_position_embeddings"]),
        Keys.LLM.EMBEDDING_LENGTH: ("uint32", cfg["hidden_size"]),
        Keys.LLM.FEED_FORWARD_LENGTH: ("uint32", cfg["intermediate_size"]),
        Keys.Attention.HEAD_COUNT: ("uint32", heads),
        Keys.Attention.HEAD_COUNT_KV: ("uint32", kv_heads),
        Keys.Attention.LAYERNORM_RMS_EPS: ("float32", cfg["rms_norm_eps"]),
        Keys.Rope.FREQ_BASE: ("float32", cfg["rope_theta"]),
        Keys.Attention.KEY_LENGTH: ("uint32", head_dim),
        Keys.Attention.VALUE_LENGTH: ("uint32", head_dim),
        Keys.Rope.DIMENSION_COUNT: ("uint32", int(head_dim * cfg.get("partial_rotary_factor", 1.0))),
    }
    if arch == "gemma3":
        keys[Keys.Attention.SLIDING_WINDOW] = ("uint32", cfg["sliding_window"])
    rope = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    if rope_type == "linear":
        keys[Keys.Rope.SCALING_TYPE] = ("string", "linear")
        keys[Keys.Rope.SCALING_FACTOR] = ("float32", rope["factor"])
    if rope_type == "longrope":
        keys[Keys.Rope.SCALING_ORIG_CTX_LEN] = ("uint32", cfg["original_max_position_embeddings"])
    for key, (kind, value) in keys.items():
        key = key.format(arch=header_arch)
        if key.split(".", 1)[1] not in skip_keys:
            getattr(w, f"add_{kind}")(key, value)
    if arch == "gemma3" and "sliding_window_pattern" not in skip_keys:  # llama.cpp writes one bool per layer
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    _tokenizer(w, ckpt)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[{"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3",
                                                      "gemma3": "GEMMA3", "phi3": "PHI3"}[arch]], n_layers)
    weights = {k: np.array(v.astype(mx.float32)) for f in sorted(ckpt.glob("*.safetensors"))
               for k, v in mx.load(str(f)).items()}
    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim, cfg["rope_theta"]))
    if rope_type == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for hf, data in weights.items():
        if cfg.get("tie_word_embeddings") and hf == "lm_head.weight":
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        if name in skip_tensors:
            continue
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = _permute(data, heads)
        if arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute(data, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if data.ndim == 2 and qtype != "F32":
            if qtype == "F16":
                w.add_tensor(name, data.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(data, T[qtype]), raw_dtype=T[qtype])
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
