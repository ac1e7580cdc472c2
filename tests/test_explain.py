"""`mlxbun explain`: the resolved forward of every covered arch, of a checkpoint, and the refusals."""

import json
import subprocess
import sys

import pytest
from mlx.utils import tree_flatten

from mlxbun.errors import ConfigError, MlxbunError, UnsupportedModelError
from mlxbun.explain import explain
from mlxbun.models.universal.kinds_hybrid import (
    HybridBlock,
    MixerKind,
)
from mlxbun.models.universal.loader import build_model
from mlxbun.models.universal.not_covered import NOT_COVERED
from mlxbun.profile import L1_DEDICATED_TYPES
from mlxbun.zoo import ARCHS, tiny_config

UNIVERSAL_ARCHS = [a for a in ARCHS if a not in L1_DEDICATED_TYPES]  # gemma3n: test_gemma3n_* below


@pytest.mark.parametrize("arch", UNIVERSAL_ARCHS)
def test_every_covered_arch_renders_every_module_and_layer(arch):
    e = explain(arch)
    text = e.text()
    assert text.splitlines()[0].startswith(f"{e.model_type}: ")
    model = build_model(tiny_config(arch))
    # a hybrid whose every layer is its recurrent mixer (mamba2) has no attention, no mlp
    recurrent_only = all(s.mixer is not MixerKind.ATTENTION for s in model.args.layers) and (
        model.descriptor.hybrid.block is not HybridBlock.PARALLEL)  # falcon_h1 attends beside it
    for title in ("embedding", "block (", "attention (", "mlp (", "final norm and head", "layers"):
        assert (f"\n{title}" in text) != (recurrent_only and title in ("attention (", "mlp (")), title
    # every module of the parameter tree is named in the listing (parameter leaves and the
    # per-head LayerNorm list of stablelm aside)
    for name, _ in tree_flatten(model.parameters()):
        for part in name.split(".")[:-1]:
            if not part.isdigit() and part != "norms":
                assert part in text, f"{arch}: module {part!r} ({name}) missing from\n{text}"
    # the layer groups partition the layers, in order of first appearance
    seen = [i for g in e.layers for i in g.layers]
    assert sorted(seen) == list(range(model.args.n_layers))
    assert json.loads(json.dumps(e.as_dict()))["model_type"] == e.model_type


def _section(text: str, title: str) -> str:
    """The lines of one section (title line excluded)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return "\n".join(lines[start + 1:end])


def test_olmo2_shows_post_norms_and_flat_qk_norm():
    text = explain("olmo2").text()
    block = _section(text, "block (")
    assert "h = h + post_attention_layernorm(self_attn(h))" in block
    assert "h = h + post_feedforward_layernorm(mlp(h))" in block
    assert "input_layernorm" not in text
    attn = _section(text, "attention (").splitlines()
    qk = next(i for i, ln in enumerate(attn) if "q_norm(q), k_norm(k)" in ln)
    heads = next(i for i, ln in enumerate(attn) if "heads(q)" in ln)
    assert qk < heads and "flat" in attn[qk] and "H*hd / KV*hd" in attn[qk]


def test_gemma3_text_shows_the_sliding_pattern_and_the_local_rope_base():
    e = explain("gemma3_text")
    cfg = tiny_config("gemma3_text")
    period = cfg["sliding_window_pattern"]
    globals_ = [i for i in range(cfg["num_hidden_layers"]) if (i + 1) % period == 0]
    by_kind = {g.attention: g for g in e.layers}
    assert set(by_kind) == {f"sliding window {cfg['sliding_window']}", "global"}
    assert list(by_kind["global"].layers) == globals_
    local = by_kind[f"sliding window {cfg['sliding_window']}"]
    assert f"base {cfg['rope_local_base_freq']} (rope_local_base_freq, unscaled)" in local.rope
    assert local.cache == f"RotatingKVCache({cfg['sliding_window']})"
    assert f"base {cfg['rope_theta']}" in by_kind["global"].rope and "linear" in by_kind["global"].rope
    text = e.text()
    assert "clip_residual" in text and "bfloat16" in text
    assert "query_pre_attn_scalar**-0.5" in text


def test_nanochat_shows_the_compiled_softcap_and_functional_norms():
    text = explain("nanochat").text()
    head = _section(text, "final norm and head")
    assert "logits = c * tanh(logits / c)" in head and "c = 15.0" in head
    assert "h = rms_norm(h)" in _section(text, "embedding")
    assert "q, k = rms_norm(q), rms_norm(k)" in text and "after rope" in text


@pytest.mark.parametrize("arch, expected", [
    ("gemma2", ["c = attn_logit_softcapping = 50.0", "c = final_logit_softcapping = 30.0",
                "embed_tokens.as_linear(h)", "h = h * D**0.5"]),
    ("cohere2", ["NoPE", "sdpa(q.astype(f32 if q is f16)", "logits = logits * logit_scale"]),
    ("gpt_neox", ["attention(input_layernorm(h)) + mlp(post_attention_layernorm(h)) + h",
                  "model.embed_out(h)", "4 * D", "dims 4 of hd (rotary_pct 0.25)"]),
    ("minicpm", ["scale_depth / N**0.5", "h = h / (hidden_size / dim_model_base)"]),
    ("granite", ["scale = attention_multiplier", "logits = logits / logits_scaling"]),
    ("ministral3", ["llama-4 query scale"]),
    ("phi", ["sdpa(q.astype(float32), k, v).astype(v.dtype)", "x = input_layernorm(h)"]),
    ("lille-130m", ["x = norm(x)", "transformer.tok_embeddings.as_linear(h)"]),
    ("deepseek_v2", ["q = q_b_proj(q_a_layernorm(q_a_proj(x)))", "split(kv_a_proj_with_mqa(x), [kv])",
                     "k = concat([k_nope, repeat(k_pe, H)])", "w = take_along_axis(p, experts) * scaling"]),
    ("deepseek_v3", ["c, k_pe = cache.update_and_fetch(c, k_pe)", "o = sdpa(q_nope, k, v, scale, mask=pe)",
                     "L == 1: q_nope = embed_q(q_nope); k = v = c"]),
    ("minicpm3", ["SuScaledRoPE over dr", "dv = D // H = 16 (not read from the config)", "RMSNorm(kv, eps=1e-05)",
                  "scale = (dn+dr)**-0.5 = ", "h = h * scale_emb", "scale_depth / N**0.5"]),
    ("glm4_moe_lite", ["RMSNorm(kv, eps=1e-05 (rms_norm_eps))", "o = sdpa(q_nope, k, v, scale, mask=pe)",
                       "initialize_rope over dr, traditional=True", "/ (sum + 1e-20)"]),
    ("youtu_llm", ["traditional=True (rope_traditional)", "dv = v_head_dim = 24", "scale = (dn+dr)**-0.5 = ",
                   "k, v = cache.update_and_fetch(k, v)"]),
    ("mistral4", ["q_nope, q_pe = q_nope * s, q_pe * s", "scale = apply_yarn_mscale((dn+dr)**-0.5, rope_parameters)",
                  "L > 1: o = sdpa(concat([q_nope, q_pe]), k, v, scale, mask)", "/ (sum + 1e-20)",
                  "p = softmax(logits.astype(float32))"]),
    ("deepseek_v32", ["cache[0].update_and_fetch(c, k_pe)", "index_topk = 8", "CacheList(KVCache, KVCache)",
                      "L == 1: c, k_pe = gather(c, top), gather(k_pe, top)"]),
])
def test_arch_specific_steps_are_shown(arch, expected):
    text = explain(arch).text()
    for snippet in expected:
        assert snippet in text, f"{arch}: {snippet!r} missing from\n{text}"


@pytest.mark.parametrize("arch", ["deepseek_v2", "minicpm3", "glm4_moe_lite", "youtu_llm", "mistral4",
                                  "deepseek_v32", "glm_moe_dsa"])
def test_an_mla_rows_sizes_are_its_attention_head_dims(arch):
    """An MLA row shows dn / dr / dv / kv, not hd (a config's head_dim is transformers' copy of
    qk_rope_head_dim, which mlx-lm does not read) nor KV (the latent is one head)."""
    sizes = {s: (src, v) for s, src, v in explain(arch).sizes}
    assert "hd" not in sizes and "KV" not in sizes
    assert sizes["q/k head dim"][1] == sizes["dn"][1] + sizes["dr"][1]


def test_a_checkpoint_directory_explains_its_config(zoo):
    path = zoo("olmo2", quant=4)
    e = explain(path)
    assert e.config_source == str(path / "config.json")
    assert e.coverage.startswith("ok")
    assert e.sections == explain("olmo2").sections  # the zoo checkpoint's config is the tiny config
    assert explain(path / "config.json").sections == e.sections


def test_the_cli_prints_the_listing_and_json():
    run = [sys.executable, "-m", "mlxbun", "explain"]
    out = subprocess.run([*run, "llama"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("llama: ") and "q_proj" in out.stdout and "layers 0-1" in out.stdout
    out = subprocess.run([*run, "zoo:qwen3", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model_type"] == "qwen3" and data["descriptor"]["qk_norm"]["at"] == "heads"
    assert {s["symbol"] for s in data["sizes"]} == {"D", "N", "H", "KV", "hd", "I", "V"}


@pytest.mark.parametrize("target, error, needle", [
    ("definitely_not_an_arch", UnsupportedModelError, "definitely_not_an_arch"),
    ("kimi_linear", UnsupportedModelError, NOT_COVERED["kimi_linear"]),
    ("./no/such/checkpoint", ConfigError, "no/such/checkpoint"),
])
def test_refusals_name_the_culprit(target, error, needle):
    with pytest.raises(error) as e:
        explain(target)
    assert needle in str(e.value)


def test_cli_refusals_are_one_line_errors(tmp_path):
    for target, needle in (("definitely_not_an_arch", "definitely_not_an_arch"),
                           ("kimi_linear", "kimi_linear"), (str(tmp_path), "config.json")):
        out = subprocess.run([sys.executable, "-m", "mlxbun", "explain", target],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and needle in out.stderr
        assert out.stderr.startswith("mlxbun explain: error: ")


def test_model_names_resolve_through_the_grammar(zoo_root, monkeypatch):
    """A zoo name with options explains that checkpoint's own config (here: wider heads)."""
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    wide = explain("zoo:llama,head_dim=32")
    assert wide.config_source.endswith("tiny-llama-hd32/config.json")
    assert ("hd", "head_dim or D // H", 32) in wide.sizes and ("hd", "head_dim or D // H", 16) in explain("llama").sizes
    with pytest.raises(MlxbunError, match="unknown zoo variant 'q9'"):
        explain("zoo:llama@q9")
    with pytest.raises(MlxbunError, match="repo 'org/repo' not found"):
        explain("org/repo")


def test_moe_layers_render_the_router_experts_and_which_layers_route():
    e = explain("glm4_moe")
    text = e.text()
    assert {s: v for s, _, v in e.sizes if s in ("E", "k", "Ie", "Is")} == {"E": 4, "k": 2, "Ie": 64, "Is": 64}
    dense = _section(text, "mlp (model.layers[i].mlp) on the dense layers")
    assert "down_proj(silu(gate_proj(x)) * up_proj(x))" in dense
    moe = _section(text, "mlp (model.layers[i].mlp): mixture of experts")
    assert "x @ gate.weight.T" in moe and "sigmoid(logits.astype(float32))" in moe
    assert "e_score_correction_bias" in moe and "routed_scaling_factor" in moe and "= 2.5" in moe
    assert "y = y + shared_experts(x)" in moe and "i >= first_k_dense_replace" in moe
    assert [(g.layers, g.mlp) for g in e.layers] == [((0,), "dense mlp"), ((1,), "MoE (4 experts, top 2)")]
    assert "layer 1: global; rope as above; cache KVCache; MoE (4 experts, top 2)" in text

    mixtral = explain("mixtral").text()
    assert "\nmlp (model.layers[i].mlp)" not in mixtral  # every layer routes: no dense mlp section
    moe = _section(mixtral, "mlp (model.layers[i].block_sparse_moe): mixture of experts")
    assert "argpartition(-logits, kth=k - 1)[..., :k]" in moe and "precise=True" in moe
    assert "routed in router (parameter-free, mlxbun only" in moe
    qwen2 = _section(explain("qwen2_moe").text(), "mlp (model.layers[i].mlp): mixture of experts")
    assert "y = y + sigmoid(shared_expert_gate(x)) * shared_expert(x)" in qwen2
    qwen3 = _section(explain("qwen3_moe").text(), "mlp (model.layers[i].mlp): mixture of experts")
    assert "argpartition(p, kth=-k)[..., -k:]" in qwen3 and "renormalized (norm_topk_prob = True)" in qwen3
    assert "(no mlp" not in qwen3


def test_klear_afmoe_mellum_render_their_routers_gate_and_ropes():
    klear = _section(explain("Klear").text(), "mlp (model.layers[i].mlp): mixture of experts")
    assert "argpartition(-(s + expert_bias), kth=k - 1)[..., :k]" in klear
    assert "w = w.astype(x.dtype)" in klear and "no k > 1 guard" in klear
    assert "c = softmax(coefficient(x), precise=True)" in klear
    assert "y = y * c[..., :1] + shared_experts(x) * c[..., 1:]" in klear
    text = explain("afmoe").text()
    afmoe = _section(text, "mlp (model.layers[i].mlp): mixture of experts")
    assert "logits = router.gate(x)" in afmoe and "score_func = 'sigmoid'" in afmoe
    assert "expert_bias [E] on the block" in afmoe and "w = w * route_scale" in afmoe and "= 2.826" in afmoe
    assert "routed on: i >= num_dense_layers" in afmoe
    assert "o = o * sigmoid(gate_proj(x))" in text and "h = h * math.sqrt(D)" in text
    assert "layer 1: global; NoPE (no rotary embedding); cache KVCache; MoE (4 experts, top 2)" in text
    mellum = explain("mellum").text()
    assert "base 10000.0 (rope_parameters['sliding_attention']); cache RotatingKVCache(16)" in mellum
    assert "base 500000.0 (rope_parameters['full_attention']); cache KVCache" in mellum


def test_step3p5_renders_its_gate_heads_router_and_clamps():
    text = explain("step3p5").text()
    assert "o = o * sigmoid(g_proj(x))[..., None]" in text and "use_head_wise_attn_gate = True" in text
    assert "(sliding layers: H, KV = 8, 2)" in text and "from attention_other_setting" in text
    moe = _section(text, "mlp (model.layers[i].mlp): mixture of experts")
    assert "logits = gate.gate(x)" in moe and "router_bias [E] on gate" in moe
    assert "w = take_along_axis(s, experts) / (sum + 1e-20)" in moe and "w = w * moe_router_scaling_factor" in moe
    assert "clamped SwiGLU where swiglu_limits[i] > 0" in moe and "routed on: i in moe_layers_enum" in moe
    assert "q, k = rope(q, offset), rope(k, offset)      # per layer, see layers" in text
    assert "layer 0: global; yarn rope, dims 8 of hd, base 1000000.0" in text
    assert "layers 1, 3: sliding window 16; default rope, dims hd, base 10000.0" in text


def test_gemma3n_lists_its_port_every_module_and_the_kv_sharing():
    from mlxbun.models.gemma3n.loader import build_gemma3n

    e = explain("gemma3n")
    text = e.text()
    assert text.splitlines()[0].startswith("gemma3n: the gemma3n port's forward, as mlx-lm 0.32.2 models/gemma3n.py")
    for title in ("embedding", "block (", "attention (", "mlp (", "final norm and head", "layers"):
        assert f"\n{title}" in text, title
    model = build_gemma3n(tiny_config("gemma3n"))
    for name, _ in tree_flatten(model.parameters()):
        for part in name.split(".")[:-1]:
            if not part.isdigit() and part not in ("model", "language_model", "layers"):
                assert part in text, f"module {part!r} ({name}) missing from\n{text}"
    seen = [i for g in e.layers for i in g.layers]
    assert sorted(seen) == list(range(5))
    assert "layer 3: sliding window 16; rope base 10000.0; cache reads layer 2's cache (KV-shared)" in text
    assert "layer 4: global; rope base 1000000.0; cache reads layer 1's cache (KV-shared)" in text
    assert "sparsity 0.95" in text and "gelu_topk" in text
    d = json.loads(json.dumps(e.as_dict()))
    assert d["model_type"] == "gemma3n" and d["graph"] == "the gemma3n port"
