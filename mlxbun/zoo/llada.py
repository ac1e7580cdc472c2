"""A tiny LLaDA2-MoE (`llada2_moe`) checkpoint in Hugging Face layout, built locally.

The config is the released LLaDA2.0-mini's (mlx-vlm 0.7.10 `ModelConfig` defaults) with the
sizes shrunk: hidden 64, 4 heads x 16 (2 KV heads), 2 layers (one dense, one MoE), 8 experts
in 4 groups, top-2 of the 2 best groups, one shared expert, vocab 512. Every other knob
(partial rotary 0.5, QK norm, sigmoid routing with expert bias, routed scaling 2.5,
norm_topk_prob) is kept. The zoo tokenizer has no mask token, so the last id (511) is the mask.

Weights are the mlxbun graph's seeded init plus the zoo's name-keyed noise, written under the
hub's names (`model.layers.1.mlp.experts.E.gate_proj.weight`, one tensor per expert), so a
loader must do the real checkpoint's expert stacking. `logit_scale` multiplies `lm_head`: a
random tiny model is near-uniform over 512 ids, which never clears a confidence threshold;
a larger head gives the peaked, varied confidences a threshold schedule needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from mlxbun.zoo.common import (
    Variant,
    ZooArgumentError,
    build_into,
    build_once,
    cache_root,
    check_dtype_and_seed,
    graph_fingerprint,
)
from mlxbun.zoo.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, write_tokenizer_files

__all__ = ["ARCH", "MASK_ID", "cached_llada2_checkpoint", "llada2_tiny_config", "make_llada2_checkpoint", "variant"]

ARCH = "llada2_moe"
MASK_ID = VOCAB_SIZE - 1
LOGIT_SCALE = 8.0  # lm_head gain (see the module docstring)


def llada2_tiny_config() -> dict:
    """config.json of the tiny llada2_moe (LLaDA2.0-mini knobs, shrunk sizes)."""
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "use_qkv_bias": False,
        "use_qk_norm": True,
        "use_bias": False,
        "rms_norm_eps": 1e-6,
        "norm_head": False,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "embedding_dropout": 0.0,
        "output_dropout": 0.0,
        "max_position_embeddings": 512,
        "rope_theta": 600000,
        "rope_scaling": None,
        "partial_rotary_factor": 0.5,
        "use_cache": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_experts": 8,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "output_router_logits": False,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "mask_token_id": MASK_ID,
        "norm_topk_prob": True,
        "score_function": "sigmoid",
        "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True,
        "torch_dtype": "float32",
    }


def _hub_names(params: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """Unstack `switch_mlp.P.weight` [E, out, in] into the hub's `experts.E.P.weight`."""
    out = {}
    for name, v in params.items():
        if ".switch_mlp." in name:
            head, proj = name.split(".switch_mlp.")
            for e in range(num_experts):
                out[f"{head}.experts.{e}.{proj}"] = mx.contiguous(v[e])
        else:
            out[name] = v
    return dict(sorted(out.items()))


def variant(arch: str = ARCH, *, quant=None, dtype: str = "float32", seed: int = 0,
            head_dim: int | None = None) -> Variant:
    """The checkpoint's variant: float32 weights only."""
    if quant is not None or head_dim is not None:
        raise ZooArgumentError(f"zoo arch {arch!r} is built in float weights only (no quant / head_dim)")
    check_dtype_and_seed(dtype, seed)
    if dtype != "float32":
        raise ZooArgumentError(f"zoo arch {arch!r} is built in float32 only")
    return Variant(ARCH, None, dtype, seed)


def _write_llada2(out: Path, *, seed: int, logit_scale: float) -> None:
    """Every file of the checkpoint, into the existing empty directory `out`."""
    from mlxbun.models.llada2 import LLaDA2Args, LLaDA2Model
    from mlxbun.zoo.weights import perturb

    config = llada2_tiny_config()
    mx.random.seed(seed)
    model = LLaDA2Model(LLaDA2Args.from_config(config))
    model.update(tree_map_with_path(lambda n, p: perturb(n, p, seed), model.parameters()))
    model.lm_head.weight = model.lm_head.weight * logit_scale
    weights = _hub_names(dict(tree_flatten(model.parameters())), config["num_experts"])
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")
    write_tokenizer_files(out)


def build_files(v: Variant, out: Path) -> None:
    _write_llada2(out, seed=v.seed, logit_scale=LOGIT_SCALE)


def cache_key() -> str:
    """The cache directory: the zoo fingerprint plus this graph's source."""
    from mlxbun.models import llada2

    return f"{ARCH}-{graph_fingerprint(Path(llada2.__file__))}"


def make_llada2_checkpoint(out_dir, *, seed: int = 0, logit_scale: float = LOGIT_SCALE) -> Path:
    """Write the tiny checkpoint (config, one safetensors file, zoo tokenizer files) to
    `out_dir/tiny-llada2_moe[-s<seed>]` and return that directory. Same arguments, same bytes."""
    v = variant(seed=seed)
    return build_into(out_dir, v.name, lambda out: _write_llada2(out, seed=seed, logit_scale=logit_scale))


def cached_llada2_checkpoint(*, seed: int = 0, root=None) -> Path:
    """The checkpoint in the zoo cache (`root`, else the default), built once under a file lock."""
    v = variant(seed=seed)
    return build_once(cache_root(root) / cache_key(), v.name, lambda out: build_files(v, out))
