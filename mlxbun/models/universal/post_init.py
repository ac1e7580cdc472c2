"""The named `ModelArgs.__post_init__` steps a descriptor row lists (`ArchDescriptor.post_init`),
each a transcription of the mlx-lm file's own: defaults filled, rope dicts read, per-layer lists
checked, on the dict `resolve.model_args` builds. `POST_INIT` is the dispatch table."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from mlxbun.models.universal.fields import fail as _fail
from mlxbun.models.universal.gemma4_args import gemma4_text_post_init
from mlxbun.models.universal.hybrid_args import (
    full_attn_idxs,
    lfm2_ff_dim,
    mamba2_state,
    nemotron_pattern,
    olmo_hybrid_args,
    qwen3_5_rope,
)
from mlxbun.models.universal.kinds import (
    PostInit,
    exhaustive,
)

__all__ = ["POST_INIT"]


def _kv_heads_default(a: dict, mt: str) -> None:
    if a.get("num_key_value_heads") is None:
        a["num_key_value_heads"] = a["num_attention_heads"]


def _sliding_window_sets_window_size(a: dict, mt: str) -> None:
    if a["sliding_window"] is not None:
        a["window_size"] = a["sliding_window"]


def _spark2_5_args(a: dict, mt: str) -> None:
    n = a["num_hidden_layers"]
    if a["layer_types"] is None:
        pattern = ["sliding_attention"] * 3 + ["full_attention"]
        a["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
    lt, rp = a["layer_types"], a["rope_parameters"]
    if not isinstance(lt, list) or len(lt) != n:
        raise _fail(mt, f"layer_types must list {n} layers, got {lt!r}")
    unsupported = set(lt) - {"sliding_attention", "full_attention"}
    if unsupported:
        raise _fail(mt, f"unsupported layer types: {sorted(unsupported)}")
    if not isinstance(rp, dict) or set(lt) - set(rp):
        raise _fail(mt, f"rope_parameters needs an entry for each of {sorted(set(lt))}, got {rp!r}")
    if a["num_attention_heads"] % a["num_key_value_heads"]:
        raise _fail(mt, "num_attention_heads must be divisible by num_key_value_heads")
    for kind in set(lt):
        dims = int(a["head_dim"] * float(rp[kind].get("partial_rotary_factor", 1.0)))
        if dims <= 0 or dims > a["head_dim"] or dims % 2:
            raise _fail(mt, f"invalid rotary dimension {dims} for {kind} with head_dim={a['head_dim']}")


def _afm7_args(a: dict, mt: str) -> None:
    if not 0 <= a["num_kv_reuse_layers"] < a["num_layers"]:
        raise _fail(mt, f"num_kv_reuse_layers must be in [0, num_layers): the KV-reuse layers read the last "
                        f"regular layer's cache, got {a['num_kv_reuse_layers']} of {a['num_layers']}")
    if a["num_heads"] % a["num_kv_heads"]:
        raise _fail(mt, "num_heads must be divisible by num_kv_heads")


def _muse_glimmer_args(a: dict, mt: str) -> None:
    n, rp = a["num_hidden_layers"], a["rope_parameters"]
    if rp and "rope_theta" in rp:
        a["rope_theta"] = rp["rope_theta"]
    if a["layer_types"] is None:
        pattern = ["sliding_attention"] * 3 + ["full_attention"]
        a["layer_types"] = [pattern[i % 4] for i in range(n)]
    if a["layer_rope_theta"] is None:
        a["layer_rope_theta"] = [0 if t == "full_attention" else a["rope_theta"] for t in a["layer_types"]]
    for key in ("layer_types", "layer_rope_theta"):  # mlx-lm's layers index them
        if not isinstance(a[key], list) or len(a[key]) < n:
            raise _fail(mt, f"{key} must hold an entry per layer ({n}), got {a[key]!r}"[:200])


def _mamba_args(a: dict, mt: str) -> None:  # mamba's __post_init__ (its hasattr fallbacks never fire)
    if a["time_step_rank"] == "auto":
        a["time_step_rank"] = math.ceil(a["hidden_size"] / 16)
    if a["model_type"] == "falcon_mamba":
        a["use_bcdt_rms"] = True


def _jamba_args(a: dict, mt: str) -> None:
    if a["mamba_dt_rank"] == "auto":
        a["mamba_dt_rank"] = math.ceil(a["hidden_size"] / 16)
    if a["layers_block_type"] is None:
        a["layers_block_type"] = ["attention" if i % a["attn_layer_period"] == a["attn_layer_offset"] else "mamba"
                                  for i in range(a["num_hidden_layers"])]
    for kind in ("attention", "mamba"):  # mlx-lm takes each mask from the first layer of its kind
        if kind not in a["layers_block_type"]:
            raise _fail(mt, f"layers_block_type has no {kind!r} layer (mlx-lm's jamba needs one)")


def _loop_num_two(a: dict, mt: str) -> None:
    if a["loop_num"] != 2:
        raise _fail(mt, f"loop_num {a['loop_num']!r}: mlx-lm's iquestloopcoder runs loop_num 2 only")


_NAS_KEYS = {"attention": ("no_op", "replace_with_linear", "sparsify", "n_heads_in_group", "window_length",
                            "num_sink_tokens", "use_prefill_window_in_sink_attention", "unshifted_sink"),
             "ffn": ("no_op", "replace_with_linear", "sparsify", "ffn_mult")}


def _nemotron_nas_blocks(a: dict, mt: str) -> None:  # nemotron-nas's BlockConfig / ModelArgs post-inits
    blocks = []
    for i, conf in enumerate(a["block_configs"]):
        if not isinstance(conf, dict):
            raise _fail(mt, f"block_configs[{i}] must be an object, got {conf!r}")
        parts = {}
        for part, keys in _NAS_KEYS.items():
            given = conf.get(part, {})
            unknown = sorted(set(given) - set(keys))
            if unknown:
                raise _fail(mt, f"block_configs[{i}].{part}: unknown key(s) {', '.join(unknown)}")
            p = {k: given.get(k, False if k in ("no_op", "replace_with_linear", "use_prefill_window_in_sink_attention",
                                                 "unshifted_sink") else None) for k in keys}
            size = "n_heads_in_group" if part == "attention" else "ffn_mult"
            if p["no_op"] or p["replace_with_linear"]:
                p[size] = None
            elif p[size] is None:
                raise _fail(mt, f"block_configs[{i}].{part}: {size} must be specified for an active block")
            elif part == "attention" and p[size] <= 0:
                raise _fail(mt, f"block_configs[{i}].attention: n_heads_in_group must be positive, got {p[size]}")
            elif part == "ffn":
                p[size] = round(p[size], 6)
            parts[part] = p
        blocks.append(parts)
    if len(blocks) != a["num_hidden_layers"]:
        raise _fail(mt, f"{len(blocks)} block_configs for num_hidden_layers {a['num_hidden_layers']}")
    rs = a["rope_scaling"]
    if rs and ("factor" not in rs or rs.get("rope_type") is None):
        raise _fail(mt, "rope_scaling must contain 'factor' and 'rope_type'")
    for i, b in enumerate(blocks):
        g = b["attention"]["n_heads_in_group"]
        if g is not None and a["num_attention_heads"] % g:
            raise _fail(mt, f"layer {i}: num_attention_heads ({a['num_attention_heads']}) must be divisible by "
                            f"n_heads_in_group ({g})")
    a["block_configs"] = blocks


def _dbrx_configs(a: dict, mt: str) -> None:
    for part, keys in (("attn_config", ("kv_n_heads", "clip_qkv", "rope_theta")),
                       ("ffn_config", ("ffn_hidden_size", "moe_num_experts", "moe_top_k"))):
        value = a[part]
        missing = [k for k in keys if not isinstance(value, Mapping) or value.get(k) is None]
        if missing:
            raise _fail(mt, f"{part} lacks {', '.join(missing)} (mlx-lm's dbrx reads them)")


def _plamo2_args(a: dict, mt: str) -> None:
    if a["mamba_enabled"] and a["mamba_step"] <= 1:
        raise _fail(mt, f"mamba_step {a['mamba_step']!r}: mlx-lm's plamo2 needs mamba_step > 1")


def _recurrent_gemma_blocks(a: dict, mt: str) -> None:
    if a["block_types"] is None:
        a["block_types"] = a["_block_types"]
    if not isinstance(a["block_types"], (list, tuple)) or "attention" not in a["block_types"]:
        raise _fail(mt, f"block_types must list the block kinds with an 'attention' one, got {a['block_types']!r}")


def _no_rope_layers_list(a: dict, mt: str) -> None:
    flags = a["no_rope_layers"]
    if not isinstance(flags, (list, tuple)) or len(flags) < a["num_hidden_layers"]:
        raise _fail(mt, f"no_rope_layers must hold a flag per layer ({a['num_hidden_layers']}), got {flags!r}")


def _gear_args(a: dict, mt: str) -> None:
    if a["num_key_value_heads"] is None:
        a["num_key_value_heads"] = a["num_attention_heads"]
    if a["query_pre_attn_scalar"] is None:
        a["query_pre_attn_scalar"] = a["head_dim"]
    if a["layer_types"] is None:
        a["layer_types"] = ["full_attention"] * a["num_hidden_layers"]
    if len(a["layer_types"]) != a["num_hidden_layers"]:
        raise _fail(mt, f"expected {a['num_hidden_layers']} layer types, got {len(a['layer_types'])}")
    if a["use_bidirectional_attention"]:
        raise _fail(mt, "use_bidirectional_attention: not supported by mlx-lm's gear")


def _nanbeige_args(a: dict, mt: str) -> None:
    if a["head_dim"] is None:
        a["head_dim"] = a["hidden_size"] // a["num_attention_heads"]
    on = [k for k in ("enable_double_loop_split", "loop_share_kv", "enable_depth_attention") if a[k]]
    if on:
        raise _fail(mt, f"{', '.join(on)}: not supported by mlx-lm's nanbeige (it raises NotImplementedError)")


def _qwen_kv_channels(a: dict, mt: str) -> None:
    if a["kv_channels"] * a["num_attention_heads"] != a["hidden_size"]:
        raise _fail(mt, f"kv_channels {a['kv_channels']!r} * num_attention_heads {a['num_attention_heads']!r} "
                        f"!= hidden_size {a['hidden_size']!r}: mlx-lm's qwen attention cannot run it "
                        "(its c_proj maps kv_channels * heads inputs from a hidden_size-wide weight)")


def _multi_query_kv_heads(a: dict, mt: str) -> None:
    kv = 1 if a["multi_query"] else a["n_head"]  # what mlx-lm's gpt_bigcode attention builds
    if a.get("num_key_value_heads") is None:
        a["num_key_value_heads"] = kv
    elif a["num_key_value_heads"] != kv:
        raise _fail(mt, f"num_key_value_heads {a['num_key_value_heads']!r} disagrees with multi_query "
                        f"{a['multi_query']!r} (mlx-lm's attention builds {kv} KV heads from multi_query)")


def _layer_types_full(a: dict, mt: str) -> None:
    if a["layer_types"] is None:
        a["layer_types"] = ["full_attention"] * a["num_hidden_layers"]


def _mistral3_llama_text(a: dict, mt: str) -> None:
    if a["model_type"] in ("ministral3", "mistral4"):
        raise _fail(mt, f"text_config.model_type {a['model_type']!r}: mlx-lm's mistral3 builds "
                        f"{a['model_type']}'s text model there, which this row (llama's) does not run")


def _require_full_layer(a: dict, mt: str) -> None:
    if "full_attention" not in a["layer_types"]:
        raise _fail(mt, "layer_types has no 'full_attention' layer (mlx-lm needs one)")


def _layer_types_olmo3(a: dict, mt: str) -> None:
    if a["layer_types"] is None:
        a["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                            for i in range(a["num_hidden_layers"])]


def _olmo3_require_both(a: dict, mt: str) -> None:
    for kind in ("sliding_attention", "full_attention"):
        if kind not in a["layer_types"]:
            raise _fail(mt, f"layer_types has no '{kind}' layer (mlx-lm's olmo3 needs both)")


def _smollm3_no_rope(a: dict, mt: str) -> None:
    if a["no_rope_layers"] is None:
        a["no_rope_layers"] = [int((i + 1) % a["no_rope_layer_interval"] != 0)
                               for i in range(a["num_hidden_layers"])]
    elif len(a["no_rope_layers"]) != a["num_hidden_layers"]:
        raise _fail(mt, "`no_rope_layers` length mismatch")


def _qwen3_rope_parameters(a: dict, mt: str) -> None:
    # transformers >= 5 nests rope_theta and rope_scaling under rope_parameters.
    if a["rope_parameters"]:
        if a["rope_theta"] is None:
            a["rope_theta"] = a["rope_parameters"].get("rope_theta")
        if a["rope_scaling"] is None:
            a["rope_scaling"] = a["rope_parameters"]
    if a["rope_theta"] is None:
        raise _fail(mt, "rope_theta is missing from the model config.")


def _phi3_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if not all(k in rs for k in ("long_factor", "type")):
            raise _fail(mt, "rope_scaling must contain keys {'long_factor', 'type'}")
        if rs["type"] not in ["longrope", "su", "linear"]:
            a["rope_scaling"] = None  # mlx-lm warns and disables the scaling
        elif rs["type"] == "linear" and not isinstance(rs.get("factor"), float):
            raise _fail(mt, "rope_scaling.factor must be a float for linear scaling")
        elif rs["type"] != "linear" and "short_factor" not in rs:
            raise _fail(mt, "rope_scaling lacks 'short_factor'")


def _internlm3_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if not all(k in rs for k in ("factor", "rope_type")):
            raise _fail(mt, "rope_scaling must contain keys {'factor', 'rope_type'}")
        if rs["rope_type"] not in ["linear", "dynamic"]:
            raise _fail(mt, "rope_scaling 'rope_type' currently only supports 'linear' or 'dynamic'")


def _internlm2_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if not all(k in rs for k in ("factor", "type")):
            raise _fail(mt, "rope_scaling must contain keys {'factor', 'type'}")
        if rs["type"] not in ["linear", "dynamic"]:
            raise _fail(mt, "rope_scaling 'type' currently only supports 'linear' or 'dynamic'")


def _nemotron_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if "factor" not in rs:
            raise _fail(mt, "rope_scaling must contain 'factor'")
        rope_type = rs.get("type") or rs.get("rope_type")
        if rope_type is None:
            raise _fail(mt, "rope_scaling must contain either 'type' or 'rope_type'")
        if rope_type not in ["linear"]:
            raise _fail(mt, "rope_scaling 'type' currently only supports 'linear'")
        if "type" not in rs:  # the Attention reads rope_scaling["type"] (KeyError in mlx-lm)
            raise _fail(mt, "rope_scaling needs the key 'type' (mlx-lm's nemotron reads it)")
        if not isinstance(rs["factor"], float):  # mlx-lm asserts a float
            raise _fail(mt, "rope_scaling.factor must be a float")


def _hunyuan_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs and not all(k in rs for k in ("alpha", "factor", "type")):
        raise _fail(mt, "rope_scaling must contain keys {'alpha', 'factor', 'type'}")


def _cohere2_head_dim_check(a: dict, mt: str) -> None:
    if a["head_dim"] * a["num_attention_heads"] != a["hidden_size"]:
        raise _fail(mt, "hidden_size must equal head_dim * num_attention_heads")


def _split_head_dim_check(a: dict, mt: str) -> None:
    if (a["hidden_size"] // a["num_attention_heads"]) * a["num_attention_heads"] != a["hidden_size"]:
        raise _fail(mt, "hidden_size must be divisible by num_attention_heads")


def _ministral3_rope(a: dict, mt: str) -> None:
    rp = a["rope_parameters"]
    if not isinstance(rp, Mapping):
        raise _fail(mt, "rope_parameters is required (mlx-lm's ministral3 reads it)")
    for key in ("rope_theta", "llama_4_scaling_beta", "original_max_position_embeddings"):
        if key not in rp:
            raise _fail(mt, f"rope_parameters lacks '{key}'")


def _rope_parameters_required(a: dict, mt: str) -> None:
    rp = a["rope_parameters"]
    if not isinstance(rp, Mapping) or "rope_theta" not in rp:
        raise _fail(mt, f"rope_parameters must be a dict holding 'rope_theta' (mlx-lm's {mt} reads it; got {rp!r})")
    a["rope_scaling"] = rp
    a["rope_theta"] = rp["rope_theta"]


def _mistral4_rope(a: dict, mt: str) -> None:
    for key in ("qk_head_dim", "head_dim"):
        if a[key] is None:
            a[key] = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
    rp = a["rope_parameters"]
    if rp is not None:
        a["rope_theta"] = rp.get("rope_theta", 100000.0)
        a["rope_scaling"] = rp
    missing = [k for k in ("llama_4_scaling_beta", "original_max_position_embeddings")
               if not isinstance(rp, Mapping) or k not in rp]
    if missing:
        raise _fail(mt, f"rope_parameters lacks {', '.join(map(repr, missing))} (mlx-lm's mistral4 "
                        "reads them for the llama-4 query scale on every call)")


def _linear_rope_scaling(a: dict, mt: str) -> None:  # qwen2_moe
    rs = a["rope_scaling"]
    if rs:
        if not all(k in rs for k in ("factor", "type")):
            raise _fail(mt, "rope_scaling must contain keys {'factor', 'type'}")
        if rs["type"] != "linear":
            raise _fail(mt, "rope_scaling 'type' currently only supports 'linear'")


def _deepseek_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:  # the attention reads rope_scaling["type"] (KeyError in mlx-lm) and asserts a float
        if "type" not in rs:
            raise _fail(mt, "rope_scaling needs the key 'type' (mlx-lm's deepseek reads it)")
        if rs["type"] == "linear" and not isinstance(rs.get("factor"), float):
            raise _fail(mt, "rope_scaling.factor must be a float")


def _hunyuan_moe_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs and not all(k in rs for k in ("factor", "type")):
        raise _fail(mt, "rope_scaling must contain keys {'factor', 'type'}")
    if not isinstance(rs, Mapping) or "alpha" not in rs:  # the attention reads rope_scaling["alpha"]
        raise _fail(mt, "rope_scaling needs the key 'alpha' (mlx-lm's hunyuan reads it)")


def _rope_parameters_theta(a: dict, mt: str) -> None:  # exaone_moe
    if a["rope_parameters"] is not None and "rope_theta" in a["rope_parameters"]:
        a["rope_theta"] = a["rope_parameters"]["rope_theta"]


def _phimoe_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs is not None:  # phimoe's attention reads these four keys of any non-null rope_scaling
        missing = [k for k in ("short_factor", "long_factor", "short_mscale", "long_mscale")
                   if not isinstance(rs, Mapping) or k not in rs]
        if missing:
            raise _fail(mt, f"rope_scaling lacks {', '.join(map(repr, missing))} (mlx-lm's phimoe "
                            "reads them)")


def _gpt_oss_layer_types(a: dict, mt: str) -> None:
    # GptOssMoeModel.__init__: the default pattern, then .index() of each kind (ValueError there)
    if a["layer_types"] is None:
        a["layer_types"] = ["sliding_attention", "full_attention"] * (a["num_hidden_layers"] // 2)
    # the forward zips layers with layer_types: extra entries are never read (fewer: refused below)
    a["layer_types"] = list(a["layer_types"])[:a["num_hidden_layers"]]
    for kind in ("sliding_attention", "full_attention"):
        if kind not in a["layer_types"]:
            raise _fail(mt, f"layer_types has no '{kind}' layer (mlx-lm's gpt_oss needs both)")


def _scaling_none_one(a: dict, mt: str) -> None:  # mimo_v2_flash's MoEGate
    a["routed_scaling_factor"] = 1.0 if a["routed_scaling_factor"] is None else a["routed_scaling_factor"]


def _laguna_lists(a: dict, mt: str) -> None:  # laguna's __post_init__, then one entry per layer
    n = a["num_hidden_layers"]
    if a["mlp_layer_types"] is None:
        a["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
    if a["num_attention_heads_per_layer"] is None:
        a["num_attention_heads_per_layer"] = [a["num_attention_heads"]] * n
    for key in ("layer_types", "mlp_layer_types", "num_attention_heads_per_layer"):
        if not isinstance(a[key], list) or len(a[key]) < n:
            raise _fail(mt, f"'{key}' must list one entry per layer ({n}), got {a[key]!r}")


def _layer_type_ropes(a: dict, mt: str) -> None:  # mellum
    lt, rp = a["layer_types"], a["rope_parameters"]
    if not isinstance(lt, list) or len(lt) != a["num_hidden_layers"]:
        raise _fail(mt, f"layer_types must list one kind per layer ({a['num_hidden_layers']}), "
                        f"got {lt!r}")
    odd = sorted({t for t in lt if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise _fail(mt, f"layer_types holds {', '.join(map(repr, odd))}; mellum's layers are "
                        "'full_attention' or 'sliding_attention'")
    _require_full_layer(a, mt)
    for t in sorted(set(lt)):
        if not isinstance(rp, Mapping) or not isinstance(rp.get(t), Mapping) or "rope_theta" not in rp[t]:
            raise _fail(mt, f"rope_parameters needs '{t}' with its 'rope_theta' (mlx-lm reads "
                            "rope_parameters[layer_type])")


POST_INIT: Mapping[PostInit, Callable[[dict, str], None]] = exhaustive(PostInit, {
    PostInit.KV_HEADS_DEFAULT: _kv_heads_default,
    PostInit.LAYER_TYPES_FULL: _layer_types_full,
    PostInit.REQUIRE_FULL_LAYER: _require_full_layer,
    PostInit.LAYER_TYPES_OLMO3: _layer_types_olmo3,
    PostInit.OLMO3_REQUIRE_BOTH: _olmo3_require_both,
    PostInit.SMOLLM3_NO_ROPE: _smollm3_no_rope,
    PostInit.QWEN3_ROPE_PARAMETERS: _qwen3_rope_parameters,
    PostInit.PHI3_ROPE_SCALING: _phi3_rope_scaling,
    PostInit.INTERNLM3_ROPE_SCALING: _internlm3_rope_scaling,
    PostInit.INTERNLM2_ROPE_SCALING: _internlm2_rope_scaling,
    PostInit.NEMOTRON_ROPE_SCALING: _nemotron_rope_scaling,
    PostInit.HUNYUAN_ROPE_SCALING: _hunyuan_rope_scaling,
    PostInit.COHERE2_HEAD_DIM_CHECK: _cohere2_head_dim_check,
    PostInit.SPLIT_HEAD_DIM_CHECK: _split_head_dim_check,
    PostInit.NEOX_DIVISIBLE: _split_head_dim_check,
    PostInit.MINISTRAL3_ROPE: _ministral3_rope,
    PostInit.LINEAR_ROPE_SCALING: _linear_rope_scaling,
    PostInit.DEEPSEEK_ROPE_SCALING: _deepseek_rope_scaling,
    PostInit.ROPE_PARAMETERS_THETA: _rope_parameters_theta,
    PostInit.HUNYUAN_MOE_ROPE_SCALING: _hunyuan_moe_rope_scaling,
    PostInit.GPT_OSS_LAYER_TYPES: _gpt_oss_layer_types,
    PostInit.PHIMOE_ROPE_SCALING: _phimoe_rope_scaling,
    PostInit.LAYER_TYPE_ROPES: _layer_type_ropes,
    PostInit.SCALING_NONE_ONE: _scaling_none_one,
    PostInit.LAGUNA_LISTS: _laguna_lists,
    PostInit.MISTRAL4_ROPE: _mistral4_rope,
    PostInit.ROPE_PARAMETERS_REQUIRED: _rope_parameters_required,
    PostInit.MISTRAL3_LLAMA_TEXT: _mistral3_llama_text,
    PostInit.LFM2_FF_DIM: lfm2_ff_dim,
    PostInit.FULL_ATTN_IDXS: full_attn_idxs,
    PostInit.QWEN3_5_ROPE: qwen3_5_rope,
    PostInit.OLMO_HYBRID_ARGS: olmo_hybrid_args,
    PostInit.MAMBA2_STATE: mamba2_state,
    PostInit.NEMOTRON_PATTERN: nemotron_pattern,
    PostInit.GEMMA4_TEXT: gemma4_text_post_init,
    PostInit.MULTI_QUERY_KV_HEADS: _multi_query_kv_heads,
    PostInit.QWEN_KV_CHANNELS: _qwen_kv_channels,
    PostInit.NANBEIGE_ARGS: _nanbeige_args,
    PostInit.GEAR_ARGS: _gear_args,
    PostInit.NO_ROPE_LAYERS_LIST: _no_rope_layers_list,
    PostInit.RECURRENT_GEMMA_BLOCKS: _recurrent_gemma_blocks,
    PostInit.PLAMO2_ARGS: _plamo2_args,
    PostInit.DBRX_CONFIGS: _dbrx_configs,
    PostInit.NEMOTRON_NAS_BLOCKS: _nemotron_nas_blocks,
    PostInit.LOOP_NUM_TWO: _loop_num_two,
    PostInit.JAMBA_ARGS: _jamba_args,
    PostInit.MAMBA_ARGS: _mamba_args,
    PostInit.SPARK2_5_ARGS: _spark2_5_args,
    PostInit.MUSE_GLIMMER_ARGS: _muse_glimmer_args,
    PostInit.AFM7_ARGS: _afm7_args,
    PostInit.SLIDING_WINDOW_SETS_WINDOW_SIZE: _sliding_window_sets_window_size,
})
