"""Tiny DiffusionGemma checkpoints in Hugging Face layout (mlx-vlm's loader reads them strictly).

The config is the real google/diffusiongemma-26B-A4B one (mlx-vlm's `TextConfig` defaults)
shrunk: hidden 64, a sliding and a global layer (the global one with its own head dim and
kv-head count, K reused as V, partial proportional RoPE), 4 experts top-2 next to the dense
MLP, canvas 16, the zoo tokenizer's 512-token vocab. The weights are mlxbun's graph initialized
from a seeded RNG and perturbed by name like every zoo arch (so norms, layer scalars and the
router scales are not their neutral init), saved under HF names: the fused expert tensors
without ".weight", the encoder's own `layer_scalar`s, nothing for the tied encoder/head.
generation_config.json carries DiffusionGemma's generation defaults (entropy-bound sampler,
linear temperature schedule, stability stop).

    make_diffusion_checkpoint(out_dir)            # -> out_dir/tiny-diffusion_gemma
    cached_diffusion_checkpoint(seed=1)           # built once per cache root

(the registry also reaches it as `make_checkpoint("diffusion_gemma", ...)`).
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
from mlxbun.zoo.tokenizer import (
    BOS_ID,
    EOS_ID,
    GENERATION_EOS_IDS,
    PAD_ID,
    VOCAB_SIZE,
    write_tokenizer_files,
)

ARCH = "diffusion_gemma"
CANVAS_LENGTH = 16
SLIDING_WINDOW = 16  # a 12-token prompt plus one canvas already crosses it
HEAD_SHARPNESS = 4.0  # final-norm gain: logits ~4x a random init's

__all__ = [
    "ARCH",
    "cached_diffusion_checkpoint",
    "diffusion_generation_config",
    "make_diffusion_checkpoint",
    "tiny_diffusion_config",
    "variant",
]


def tiny_diffusion_config() -> dict:
    """config.json of the tiny checkpoint."""
    text = {
        "model_type": "diffusion_gemma_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": "vision",
        "num_experts": 4,
        "top_k_experts": 2,
    }
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "text_config": text,
        "vision_config": None,  # text only: mlx-vlm builds no vision tower
        "canvas_length": CANVAS_LENGTH,
        "boi_token_id": 255999,
        "eoi_token_id": 258882,
        "image_token_id": 258880,
        "eos_token_id": list(GENERATION_EOS_IDS),
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    }


def diffusion_generation_config() -> dict:
    """generation_config.json: the zoo's token ids plus DiffusionGemma's generation defaults
    (transformers' DiffusionGemmaGenerationConfig defaults)."""
    return {
        "bos_token_id": BOS_ID,
        "eos_token_id": list(GENERATION_EOS_IDS),
        "pad_token_id": PAD_ID,
        "do_sample": False,
        "max_denoising_steps": 48,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
        "t_min": 0.4,
        "t_max": 0.8,
        "stability_threshold": 1,
        "confidence_threshold": 0.005,
    }


def _hf_name(param: str) -> str:
    # HF keeps the fused expert tensors as bare parameters (no ".weight")
    for stem in (".experts.gate_up_proj.weight", ".experts.down_proj.weight"):
        if param.endswith(stem):
            return param[: -len(".weight")]
    return param


def build_weights(seed: int, dtype: str = "float32") -> dict[str, mx.array]:
    """HF-named tensors of the tiny graph: seeded init, perturbed by name, cast."""
    from mlxbun.models.diffusion_gemma.config import config_from_dict
    from mlxbun.models.diffusion_gemma.model import DiffusionGemmaModel
    from mlxbun.zoo.weights import perturb

    mx.random.seed(seed)
    model = DiffusionGemmaModel(config_from_dict(tiny_diffusion_config()))
    model.update(tree_map_with_path(lambda name, p: perturb(name, p, seed), model.parameters()))
    # A sharper head than random init gives: confident positions, several reveals per step,
    # early stops and stable canvases, so the samplers' branches all run on the tiny model.
    norm = model.model.decoder.norm
    norm.weight = norm.weight * HEAD_SHARPNESS
    target = getattr(mx, dtype)
    weights = {
        _hf_name(k): (v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in tree_flatten(model.parameters())
    }
    mx.eval(weights)
    return weights


def variant(arch: str = ARCH, *, quant=None, dtype: str = "float32", seed: int = 0,
            head_dim: int | None = None) -> Variant:
    """The checkpoint's variant: float weights only (mlx-vlm's loader takes no quantization)."""
    if quant is not None or head_dim is not None:
        raise ZooArgumentError(f"zoo arch {arch!r} is built in float weights only (no quant / head_dim)")
    check_dtype_and_seed(dtype, seed)
    return Variant(ARCH, None, dtype, seed)


def build_files(v: Variant, out: Path) -> None:
    """Every file of the checkpoint, into the existing empty directory `out`."""
    from mlxbun.zoo.weights import save_shards

    config = tiny_diffusion_config()
    config["torch_dtype"] = v.dtype
    weights = build_weights(v.seed, v.dtype)
    save_shards(weights, out, total_parameters=sum(w.size for w in weights.values()), fmt="pt")
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4), encoding="utf-8")
    write_tokenizer_files(out)
    # after the tokenizer files: this replaces their plain generation_config.json
    (out / "generation_config.json").write_text(
        json.dumps(diffusion_generation_config(), indent=2) + "\n", encoding="utf-8"
    )


def cache_key() -> str:
    """The cache directory: the zoo fingerprint plus this graph's source."""
    from mlxbun.models import diffusion_gemma

    return f"{ARCH}-{graph_fingerprint(Path(diffusion_gemma.__file__).parent)}"  # the package


def make_diffusion_checkpoint(out_dir, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Build `out_dir/tiny-diffusion_gemma[-<dtype>][-s<seed>]`; same arguments, same bytes."""
    v = variant(seed=seed, dtype=dtype)
    return build_into(out_dir, v.name, lambda out: build_files(v, out))


def cached_diffusion_checkpoint(*, seed: int = 0, dtype: str = "float32", root=None) -> Path:
    """The checkpoint in the zoo cache (`root`, else the default), built once under a file lock."""
    v = variant(seed=seed, dtype=dtype)
    return build_once(cache_root(root) / cache_key(), v.name, lambda out: build_files(v, out))
