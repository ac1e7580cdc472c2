"""Tiny hybrid / recurrent models for the tests: mlx-lm 0.32.2's own graphs (qwen3_next, qwen3_5
text, lfm2, nemotron_h, mamba2, falcon_h1) built in process with `mlxbun.zoo.weights.build_model`, each from
its transformers configuration class shrunk to hidden 64 with at least one recurrent layer and,
except mamba2, one attention layer; plus the keys mlx-lm reads that transformers 5 no longer
writes (real hub configs carry them). `open_hybrid("mlx-lm:lfm2")` gives the RuntimeModel; the
"mlx-lm:" prefix leaves room for other engines' rows (e.g. the universal graph's zoo rows).
"""

from __future__ import annotations

import contextlib
import io

VOCAB = 256


def _lfm2(t):
    cfg = t.Lfm2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=128, conv_L_cache=3,
                       block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv"],
                       max_position_embeddings=512).to_dict()
    cfg.update(block_dim=64, block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0)
    return cfg


def _gated_delta(**kw):
    return dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_value_heads=4,
                linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, max_position_embeddings=512, **kw)


def _qwen3_next(t):
    cfg = t.Qwen3NextConfig(**_gated_delta(num_experts=0, layer_types=["linear_attention", "full_attention"])).to_dict()
    cfg.update(full_attention_interval=2, rope_theta=10000.0, partial_rotary_factor=0.25)
    return cfg


def _qwen3_5(t):
    cfg = t.Qwen3_5TextConfig(**_gated_delta(layer_types=["linear_attention", "full_attention"])).to_dict()
    cfg.update(model_type="qwen3_5", full_attention_interval=2)  # mlx-lm's qwen3_5 wraps the text config
    return cfg


def _nemotron_h(t):
    return t.NemotronHConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, mamba_num_heads=4, mamba_head_dim=16,
                             ssm_state_size=16, n_groups=2, conv_kernel=4, max_position_embeddings=512,
                             layers_block_type=["mamba", "attention", "mlp", "mamba"]).to_dict()


def _mamba2(t):
    cfg = t.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                         num_hidden_layers=2, n_groups=2, conv_kernel=4, expand=2).to_dict()
    cfg["intermediate_size"] = 128  # expand * hidden, as hub configs write it
    return cfg


def _falcon_h1(t):  # each layer: mamba2 and attention in parallel (a CacheList of both caches)
    return t.FalconH1Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, intermediate_size=128, mamba_d_ssm=64,
                            mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                            mamba_d_conv=4, max_position_embeddings=512).to_dict()


def _llama(t):  # attention only: a draft for the hybrids, or their target
    return t.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=512).to_dict()


HYBRIDS = {"lfm2": _lfm2, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "nemotron_h": _nemotron_h,
           "mamba2": _mamba2, "falcon_h1": _falcon_h1}
CONFIGS = {**HYBRIDS, "llama": _llama}
MODELS = [f"mlx-lm:{name}" for name in HYBRIDS]
# the universal graph's hybrid rows (zoo checkpoints: vocab 512, attention head dim 16)
UNIVERSAL = ["zoo:lfm2", "zoo:lfm2_moe", "zoo:qwen3_next", "zoo:qwen3_5", "zoo:qwen3_5_moe", "zoo:mamba2",
             "zoo:nemotron_h", "zoo:granitemoehybrid", "zoo:mamba", "zoo:plamo2",
             "zoo:recurrent_gemma", "zoo:rwkv7", "zoo:gear"]
ATTENTION_HEAD_DIM = 32  # every attention layer above: KV group size 32 divides it


def tiny_config(arch: str) -> dict:
    with contextlib.redirect_stderr(io.StringIO()):  # "PyTorch was not found"
        import transformers
    return CONFIGS[arch](transformers)


def oracle_and_universal(cfg: dict, seed: int = 3):
    """mlx-lm's model for `cfg` with random weights (norms and D near 1, the rest N(0, 0.3)), and
    the universal graph holding the same ones."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    from mlxbun.models.universal.loader import build_model

    model_cls, args_cls = _get_classes(cfg)
    ref = model_cls(args_cls.from_dict(cfg))
    mx.random.seed(seed)
    params = [(k, (1.0 + 0.1 * mx.random.normal(v.shape)) if "norm" in k or k.endswith(".D")
               else 0.3 * mx.random.normal(v.shape)) for k, v in tree_flatten(ref.parameters())]
    ref.update(tree_unflatten(params))
    ours = build_model(cfg)
    ours.load_weights(params, strict=True)
    return ref, ours


def open_hybrid(name: str, seed: int = 0):
    """The RuntimeModel of a model name with seeded weights: "mlx-lm:ARCH" one of the configs
    above (built in process), any other name through `mlxbun.locate` (e.g. "zoo:lfm2" once the
    zoo has the row; the seed as the name's ",seed=N")."""
    engine, _, arch = name.partition(":")
    if engine != "mlx-lm":
        from mlxbun.locate import open_runtime

        return open_runtime(f"{name},seed={seed}" if seed else name)
    from mlxbun.models.mlxlm import ensure_runtime
    from mlxbun.zoo.weights import build_model

    if arch not in CONFIGS:
        raise KeyError(f"unknown test model {name!r} (known: mlx-lm:{', mlx-lm:'.join(CONFIGS)})")
    return ensure_runtime(build_model(tiny_config(arch), seed))


class _Detokenizer:
    def reset(self):
        self.last_segment = ""

    def add_token(self, token):
        self.last_segment = f"<{token}>"

    def finalize(self):
        self.last_segment = ""


class IdTokenizer:
    """Prompts are token ids; text is "<id>" per token; no EOS (every run makes max_tokens)."""

    eos_token_ids = ()

    @property
    def detokenizer(self):
        return _Detokenizer()
