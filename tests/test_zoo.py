"""The tiny checkpoint zoo: every arch builds and loads in mlx-lm (strict weights, tokenizer
included), variants quantize exactly as mlx_lm.convert, builds are byte-deterministic, the hub
cache layout is recognized by huggingface_hub, and the CLI builds and refuses cleanly."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxbun.errors import MlxbunError, UnsupportedModelError
from mlxbun.models.switch_layers import gather_mm_supported
from mlxbun.zoo import (
    ARCHS,
    BUILDERS,
    ORACLE_VLM_ARCHS,
    TOWER_ZOO_ARCHS,
    ZooArgumentError,
    cached_checkpoint,
    make_checkpoint,
    tiny_config,
)
from mlxbun.zoo.archs import get_arch, has_experts
from mlxbun.zoo.tokenizer import BOS_ID, EOS_ID, IM_END_ID, PAD_ID, SPECIAL_TOKENS, VOCAB_SIZE

# long enough (>= 40 tokens) to cross the 16-token sliding windows and ministral3's 32-token
# original context
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs before dawn and wiped the salt from the "
    "great lens, while the gulls argued over the fishing boats drifting back into the harbour."
)

VARIANTS = {
    "q4": dict(quant=4),
    "q8": dict(quant=8),
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "mixed-bf16": dict(quant="mixed", dtype="bfloat16"),
}


# configs transformers 5 cannot read while loading the tokenizer (its config validation refuses
# gear's "conv_mixer" layer type): the tokenizer gets a blank config instead
_TOKENIZER_BLANK_CONFIG = ("gear",)


def _load(path):
    import json

    import mlx_lm

    if json.loads((path / "config.json").read_text())["model_type"] in _TOKENIZER_BLANK_CONFIG:
        import transformers

        return mlx_lm.load(str(path), tokenizer_config={"config": transformers.PretrainedConfig()})
    return mlx_lm.load(str(path))  # strict weights; the tokenizer via transformers, offline


def _forward(model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert ids[0] == BOS_ID and len(ids) >= 40
    logits = model(mx.array([ids]))
    mx.eval(logits)
    assert logits.shape == (1, len(ids), VOCAB_SIZE)
    assert mx.all(mx.isfinite(logits)).item()
    return logits


def _tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _digest(path: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_registry_has_one_builder_per_arch():
    """Every arch is built through the registry: the dense table's rows (held to mlx-lm), then
    the graphs held to mlx-vlm, then the tower zoo's VLM checkpoints (zoo.towers), whose names
    no text arch can take: each ends in a tower suffix no text arch name has. (That the registry,
    the universal descriptor table and the golden manifests agree is checked with the universal
    graph and in test_port.)"""
    from mlxbun.zoo.towers import TOWER_ARCHS, TOWER_SUFFIXES

    assert tuple(BUILDERS) == ARCHS + ORACLE_VLM_ARCHS + TOWER_ZOO_ARCHS  # a name taken twice would shrink it
    assert ARCHS and ORACLE_VLM_ARCHS == ("diffusion_gemma", "llada2_moe")
    assert TOWER_ZOO_ARCHS == tuple(TOWER_ARCHS) and "gemma3-vision" in TOWER_ZOO_ARCHS
    assert {BUILDERS[a].oracle for a in ARCHS} == {"mlx-lm"}
    assert {BUILDERS[a].oracle for a in ORACLE_VLM_ARCHS + TOWER_ZOO_ARCHS} == {"mlx-vlm"}
    assert len(set(ARCHS)) == len(ARCHS)
    assert all(name.endswith(TOWER_SUFFIXES) for name in TOWER_ZOO_ARCHS)
    assert not [a for a in ARCHS + ORACLE_VLM_ARCHS if a.endswith(TOWER_SUFFIXES)]


@pytest.mark.parametrize("arch", ORACLE_VLM_ARCHS)
def test_oracle_vlm_archs_build_through_the_registry(zoo, tmp_path, arch):
    path = zoo(arch)
    assert json.loads((path / "config.json").read_text())["model_type"] == arch
    assert make_checkpoint(arch, tmp_path).name == path.name == f"tiny-{arch}"
    assert _digest(tmp_path / path.name) == _digest(path)  # cached and direct builds: same bytes
    with pytest.raises(ZooArgumentError, match="plain directory"):
        make_checkpoint(arch, tmp_path / "hub", hf_cache=True)
    with pytest.raises(ZooArgumentError, match="float weights only"):
        cached_checkpoint(arch, quant=4, root=tmp_path)


def test_common_imports_no_other_zoo_module():
    """zoo.common is what every builder shares: importing a builder from it would be a cycle."""
    import ast

    import mlxbun.zoo.common as common

    tree = ast.parse(Path(common.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("mlxbun.zoo")]


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_checkpoint_loads_strictly_and_runs(zoo, arch):
    path = zoo(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == (get_arch(arch).model_type or arch) and config["torch_dtype"] == "float32"
    text = config.get("text_config", config)  # a VLM wrapper's (qwen3_5) text keys
    assert text["vocab_size"] == VOCAB_SIZE and isinstance(config["architectures"][0], str)
    assert (text["bos_token_id"], text["eos_token_id"]) == (BOS_ID, EOS_ID)
    assert "quantization" not in config

    # sharded, mlx-lm named, mlx metadata, index consistent with the shards
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*.safetensors"))
    assert [s.name for s in shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    from_shards = {}
    for s in shards:
        tensors, meta = mx.load(str(s), return_metadata=True)
        assert meta == {"format": "mlx"}
        from_shards.update({k: s.name for k in tensors})
    assert index["weight_map"] == dict(sorted(from_shards.items()))
    tensors = _tensors(path)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())

    model, tokenizer = _load(path)
    assert set(dict(tree_flatten(model.parameters()))) == set(tensors)
    assert tokenizer.bos_token_id == BOS_ID and EOS_ID in tokenizer.eos_token_ids
    _forward(model, tokenizer)

    # every parameter is non-trivial: no constant tensor (biases not zero, norms not all one); a
    # one-element parameter (gemma4's layer_scalar) is checked against its initial 1
    constant = [k for k, v in tensors.items() if v.ndim and v.size > 1 and mx.all(v == v.reshape(-1)[0]).item()]
    assert constant == []
    assert not [k for k, v in tensors.items() if v.size == 1 and mx.issubdtype(v.dtype, mx.floating)
                and v.item() in (0.0, 1.0)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_variant_loads_and_runs(zoo, arch, variant):
    kw = VARIANTS[variant]
    if "quant" in kw and get_arch(arch).unquantizable:  # afm7: mlx-lm's FusedLinear takes no quant mode
        with pytest.raises(TypeError, match="mode"):
            zoo(arch, **kw)
        return
    path = zoo(arch, **kw)
    config = json.loads((path / "config.json").read_text())
    dtype = kw.get("dtype", "float32")
    assert config["torch_dtype"] == dtype
    if "quant" not in kw and has_experts(arch) and not gather_mm_supported(dtype):
        # written as asked, but no engine runs unquantized half-precision experts on this device
        # (mlx's CPU gather_mm: float32 only; tests/test_moe.py holds both engines to refusing them)
        experts = {k: v for k, v in _tensors(path).items() if ".experts." in k or "switch" in k}
        assert experts and {v.dtype for v in experts.values()} == {getattr(mx, dtype)}
        return
    model, tokenizer = _load(path)
    kept = getattr(model, "cast_predicate", lambda _: True)  # qwen3_5 keeps A_log in float32
    # read before a forward: mlx-lm's gemma3n writes its AltUp coefficients back in float32 when it runs
    param_dtypes = {v.dtype for k, v in tree_flatten(model.parameters()) if kept(k)}
    logits = _forward(model, tokenizer)
    assert logits.dtype == getattr(mx, dtype)

    quant = kw.get("quant")
    if quant is None:
        assert "quantization" not in config
        assert param_dtypes <= {getattr(mx, dtype)}
        return
    q = config["quantization"]
    assert q == config["quantization_config"]
    assert (q["group_size"], q["mode"]) == (64, "affine")
    modules = dict(model.named_modules())
    quantized = {k: m for k, m in modules.items() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert quantized
    for name, m in quantized.items():  # the bits the config block says, module by module
        assert m.bits == q.get(name, q)["bits"] and m.group_size == 64, name
    if quant == "mixed":
        overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
        assert q["bits"] == 4 and overrides and all(v["bits"] == 8 for v in overrides.values())
        assert {m.bits for m in quantized.values()} == {4, 8}
        assert not any(isinstance(m, nn.QuantizedEmbedding) for m in modules.values())
        assert any(isinstance(m, nn.Embedding) for m in modules.values())
        last = str(len(model.layers) - 1)
        assert all(f".{last}." in k or k.endswith("lm_head") for k in overrides)
    else:
        assert q["bits"] == quant


@pytest.mark.parametrize("arch,dtype", [("granite", "float32"), ("gemma3_text", "bfloat16")])
def test_quantized_weights_equal_mlx_lm_convert(zoo, tmp_path, arch, dtype):
    """q4 is what `mlx_lm.convert -q` makes of the float32 checkpoint, tensor for tensor."""
    import contextlib
    import io

    from mlx_lm.convert import convert

    ours = zoo(arch, quant=4, dtype=dtype)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(zoo(arch)), str(tmp_path / "conv"), quantize=True, q_group_size=64, q_bits=4, dtype=dtype)
    a, b = _tensors(ours), _tensors(tmp_path / "conv")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    qa = json.loads((ours / "config.json").read_text())["quantization"]
    qb = json.loads((tmp_path / "conv" / "config.json").read_text())["quantization"]
    assert qa == qb


def test_configs_keep_the_arch_knobs():
    c = {a: tiny_config(a) for a in ARCHS}
    c = {a: cfg.get("text_config", cfg) for a, cfg in c.items()}  # a VLM wrapper's text keys
    for arch, cfg in c.items():
        hidden = cfg.get("hidden_size", cfg.get("n_embd", cfg.get("model_dim", cfg.get("d_model", cfg.get("hidden_dim")))))
        heads = cfg.get("num_attention_heads", cfg.get("n_head", cfg.get("n_heads", (cfg.get("num_query_heads") or [None])[0])))
        ssm = arch in ("mamba2", "mamba", "falcon_mamba", "rwkv7")  # num_heads there are SSM heads
        heads = heads if heads is not None or ssm else cfg.get("num_heads")  # afm7's attention heads
        # (mamba2 has no attention; openelm lists heads per layer)
        assert hidden == 64 and (heads == 4 or (ssm and heads is None)), arch
        assert cfg.get("max_position_embeddings", cfg.get("block_size", 512)) >= 512, arch
        if "head_dim" in cfg and cfg.get("qk_rope_head_dim") is None:  # MLA configs: head_dim is
            # transformers' bookkeeping (qk_rope_head_dim; mistral4: dn + dr), which mlx-lm's MLA never reads
            assert cfg["head_dim"] == 16, arch
        if cfg.get("layer_types"):
            kinds = set(cfg["layer_types"])
            assert len(cfg["layer_types"]) == cfg["num_hidden_layers"], arch
            assert "sliding_attention" not in kinds or "full_attention" in kinds, arch
        if "rope_parameters" in cfg and "rope_theta" in cfg:  # legacy keys agree with v5 keys
            rp = cfg["rope_parameters"].get("full_attention", cfg["rope_parameters"])
            assert rp["rope_theta"] == cfg["rope_theta"], arch
    # every layer kind appears: sliding + full, rope + no-rope
    for arch in ("gemma3_text", "olmo3", "cohere2", "exaone4"):
        assert set(c[arch]["layer_types"]) == {"sliding_attention", "full_attention"}, arch
        assert c[arch]["sliding_window"] == 16, arch
    assert c["gemma3_text"]["sliding_window_pattern"] == 3
    assert c["cohere2"]["sliding_window_pattern"] == 4
    assert c["exaone4"]["sliding_window_pattern"] == "LLLG"
    assert set(c["smollm3"]["no_rope_layers"]) == {0, 1}
    # knobs kept from the real configs
    assert c["gemma2"]["attn_logit_softcapping"] == 50.0 and c["gemma2"]["final_logit_softcapping"] == 30.0
    assert c["gemma2"]["query_pre_attn_scalar"] != c["gemma2"]["head_dim"]
    assert c["gemma"]["num_key_value_heads"] == 1 and c["llama"]["num_key_value_heads"] == 2
    assert c["llama"]["rope_scaling"]["rope_type"] == "llama3"
    assert c["gemma3_text"]["rope_scaling"] == {"factor": 8.0, "rope_type": "linear"}
    assert c["phi3"]["rope_scaling"]["type"] == "longrope"
    assert len(c["phi3"]["rope_scaling"]["long_factor"]) == int(16 * c["phi3"]["partial_rotary_factor"]) // 2
    assert c["ministral3"]["rope_parameters"]["rope_type"] == "yarn"
    assert c["ministral3"]["rope_parameters"]["llama_4_scaling_beta"] == 0.1
    assert c["granite"]["embedding_multiplier"] == 12.0 and c["granite"]["logits_scaling"] == 8.0
    assert c["cohere"]["logit_scale"] == 0.0625
    assert c["glm4"]["partial_rotary_factor"] == 0.5 and c["glm4"]["attention_bias"] is True
    assert c["gpt_neox"]["rotary_pct"] == 0.25 and c["gpt_neox"]["use_parallel_residual"] is True
    assert c["hunyuan_v1_dense"]["rope_scaling"]["alpha"] == 1000.0
    assert c["apertus"]["hidden_act"] == "xielu" and c["apertus"]["qk_norm"] is True
    assert c["nanochat"]["final_logit_softcapping"] == 15.0
    assert c["starcoder2"]["use_bias"] is True and c["starcoder2"]["tie_word_embeddings"] is True


def test_tokenizer_is_a_real_bpe_with_chat_template(zoo):
    from transformers import AutoTokenizer

    from mlxbun.zoo import tokenizer as zt

    tok = AutoTokenizer.from_pretrained(str(zoo("qwen3")))
    assert len(tok) == VOCAB_SIZE
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    text = "Hello, world! Der Zug fährt um acht Uhr. 東京は日本の首都です。\ndef f(x):\n    return x"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|begin_of_text|><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(chat, tokenize=False).endswith("assistant\n")
    gen = json.loads((zoo("qwen3") / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOS_ID, IM_END_ID] and gen["bos_token_id"] == BOS_ID
    # training is deterministic
    assert zt.tokenizer_json.__wrapped__() == zt.tokenizer_json()


def test_builds_are_byte_deterministic(tmp_path):
    for kw in (dict(), dict(quant="mixed", dtype="bfloat16")):
        a = make_checkpoint("gemma3_text", tmp_path / "a", seed=3, **kw)
        b = make_checkpoint("gemma3_text", tmp_path / "b", seed=3, **kw)
        assert a.name == b.name and _digest(a) == _digest(b)
    c = make_checkpoint("gemma3_text", tmp_path / "c", seed=4)
    a = tmp_path / "a" / "tiny-gemma3_text-s3"
    assert _digest(c)["config.json"] == _digest(a)["config.json"]
    assert _digest(c)["model-00001-of-00002.safetensors"] != _digest(a)["model-00001-of-00002.safetensors"]
    # rebuilding over an existing checkpoint replaces it
    again = make_checkpoint("gemma3_text", tmp_path / "a", seed=3)
    assert again == a and _digest(again) == _digest(b.parent / a.name)


def test_hf_cache_layout_is_recognized(tmp_path):
    from huggingface_hub import scan_cache_dir, snapshot_download

    snap = make_checkpoint("llama", tmp_path, quant=8, hf_cache=True)
    repo = tmp_path / "models--mlxbun--tiny-llama-q8"
    rev = (repo / "refs" / "main").read_text()
    assert snap == repo / "snapshots" / rev and len(rev) == 40 and int(rev, 16) >= 0
    for f in snap.iterdir():
        assert f.is_symlink() and not Path(f.readlink()).is_absolute()
        assert f.resolve().parent == (repo / "blobs").resolve()
    info = scan_cache_dir(tmp_path)
    assert info.warnings == []
    (r,) = info.repos
    assert (r.repo_id, r.repo_type, r.nb_files) == ("mlxbun/tiny-llama-q8", "model", 8)
    assert r.size_on_disk == sum(b.stat().st_size for b in (repo / "blobs").iterdir())
    assert [(x.commit_hash, set(x.refs)) for x in r.revisions] == [(rev, {"main"})]
    # the hub client resolves it offline, mlx-lm loads it, a rebuild gives the same revision
    assert Path(snapshot_download("mlxbun/tiny-llama-q8", cache_dir=tmp_path, local_files_only=True)) == snap
    _forward(*_load(snap))
    assert make_checkpoint("llama", tmp_path, quant=8, hf_cache=True) == snap


def test_cached_checkpoint_builds_once_across_processes(tmp_path):
    root = tmp_path / "cache"
    code = (
        "import sys; from mlxbun.zoo import cached_checkpoint; "
        "print(cached_checkpoint('phi', quant='mixed', root=sys.argv[1]))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    path = Path(outs[0])
    assert path.name == "tiny-phi-qmixed" and (path / "config.json").is_file()
    # nothing half-built is left behind, and a later call reuses the build
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == [path.name]
    mtime = (path / "config.json").stat().st_mtime_ns
    assert cached_checkpoint("phi", quant="mixed", root=root) == path
    assert (path / "config.json").stat().st_mtime_ns == mtime


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"'kimi_linear'.*llama.*nanochat"):
        make_checkpoint("kimi_linear", tmp_path)
    with pytest.raises(UnsupportedModelError, match="'kimi_linear'"):
        tiny_config("kimi_linear")
    with pytest.raises(ZooArgumentError, match="'afm7' is built in float weights only"):
        make_checkpoint("afm7", tmp_path, quant=4)
    for kw, pattern in [(dict(quant=3), "quant 3"), (dict(quant="q4"), "quant 'q4'"),
                        (dict(dtype="int8"), "dtype 'int8'"), (dict(seed=-1), "seed")]:
        with pytest.raises(ZooArgumentError, match=pattern) as e:
            make_checkpoint("llama", tmp_path, **kw)
        assert isinstance(e.value, MlxbunError)
    assert list(tmp_path.iterdir()) == []


def test_cli_builds_lists_and_refuses(tmp_path, capsys):
    from mlxbun.cli import main

    assert main(["zoo", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[: len(ARCHS)] == list(ARCHS)
    assert [line.split("\t")[0] for line in lines[len(ARCHS):]] == list(ORACLE_VLM_ARCHS + TOWER_ZOO_ARCHS)
    assert "gemma3-vision\t(gemma3 with its vision tower; oracle: mlx-vlm)" in lines
    assert "gemma4-towers\t(gemma4 with its vision and audio towers; oracle: mlx-vlm)" in lines
    assert main(["zoo", "ls"]) == 0 and capsys.readouterr().out.splitlines() == lines

    assert main(["zoo", "build", "qwen2", "nanochat", "--out", str(tmp_path), "--quant", "4",
                 "--dtype", "bfloat16", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["qwen2", "nanochat"]
    paths = [Path(line.split("\t")[1]) for line in lines]
    assert [p.name for p in paths] == ["tiny-qwen2-bf16-q4-s1", "tiny-nanochat-bf16-q4-s1"]
    _forward(*_load(paths[0]))

    assert main(["zoo", "build", "phi", "--out", str(tmp_path / "hub"), "--hf-cache"]) == 0
    assert "/models--mlxbun--tiny-phi/snapshots/" in capsys.readouterr().out

    assert main(["zoo", "build", "all", "--out", str(tmp_path / "all"), "--quant", "mixed"]) == 0
    out = capsys.readouterr()
    built = [line.split("\t") for line in out.out.strip().splitlines()]
    unquantizable = [a for a in ARCHS if get_arch(a).unquantizable]  # afm7: said, not built
    assert unquantizable and [a for a, _ in built] == [a for a in ARCHS if a not in unquantizable]
    assert all(f"{a}\tskipped: float weights only" in out.err for a in unquantizable)
    assert all((Path(p) / "model.safetensors.index.json").is_file() for _, p in built)

    before = sorted(tmp_path.iterdir())
    assert main(["zoo", "build", "llama", "nope", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'nope'" in err and "llama" in err
    assert main(["zoo", "build", "llama", "--out", str(tmp_path), "--quant", "5"]) == 1
    assert "quant" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before  # nothing built for a refused command


def test_head_dim_widens_the_heads_and_refuses_where_mlx_lm_ignores_it(tmp_path):
    import mlx_lm

    path = make_checkpoint("qwen3", tmp_path, head_dim=32)
    assert path.name == "tiny-qwen3-hd32"
    assert json.loads((path / "config.json").read_text())["head_dim"] == 32
    model, _ = mlx_lm.load(str(path))
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    with pytest.raises(ZooArgumentError, match="head_dim"):
        make_checkpoint("gpt_neox", tmp_path, head_dim=32)  # its ModelArgs has no head_dim
    with pytest.raises(ZooArgumentError, match="even integer"):
        make_checkpoint("qwen3", tmp_path, head_dim=7)
    # a wrapper's text model reads text_config's head_dim (gemma3n's TextConfig requires it)
    wrapped = make_checkpoint("gemma3n", tmp_path, head_dim=32)
    config = json.loads((wrapped / "config.json").read_text())
    assert config["text_config"]["head_dim"] == 32 and "head_dim" not in config
    model, _ = mlx_lm.load(str(wrapped))
    assert model.layers[4].self_attn.q_proj.weight.shape == (4 * 32, 64)
    # an MLA arch's heads are qk_nope_head_dim + qk_rope_head_dim and its value dims, never head_dim
    # (mistral4's ModelArgs has a head_dim field all the same)
    for arch in ("mistral4", "minicpm3"):
        with pytest.raises(ZooArgumentError, match="multi-head latent attention"):
            make_checkpoint(arch, tmp_path, head_dim=32)


def test_a_rebuild_replaces_only_the_zoos_own_builds(tmp_path):
    """Every build carries the marker naming the files the zoo wrote; a rebuild replaces such a
    directory, and refuses (before building, deleting nothing) a directory without the marker, one
    holding any other file, or a file in the way."""
    from mlxbun.zoo.common import MARKER

    path = make_checkpoint("llama", tmp_path)
    marker = json.loads((path / MARKER).read_text())
    assert set(marker["files"]) == {p.name for p in path.iterdir()} - {MARKER}
    assert _digest(make_checkpoint("llama", tmp_path)) == _digest(path)  # its own build: replaced
    cached = cached_checkpoint("llama", root=tmp_path / "cache")
    assert (cached / MARKER).read_bytes() == (path / MARKER).read_bytes()

    (path / "NOTES.txt").write_text("mine")
    before = _digest(path)
    with pytest.raises(ZooArgumentError, match=r"tiny-llama holds files the zoo did not write \(NOTES.txt\)"):
        make_checkpoint("llama", tmp_path)
    assert _digest(path) == before
    (path / "NOTES.txt").unlink()
    (path / MARKER).unlink()
    with pytest.raises(ZooArgumentError, match=f"tiny-llama exists and was not built by the zoo.*{MARKER}"):
        make_checkpoint("llama", tmp_path)
    (path / MARKER).write_text("not json")
    with pytest.raises(ZooArgumentError, match="not built by the zoo"):
        make_checkpoint("llama", tmp_path)
    (tmp_path / "tiny-qwen3").write_text("a file in the way")
    with pytest.raises(ZooArgumentError, match="tiny-qwen3 exists and is not a directory the zoo built"):
        make_checkpoint("qwen3", tmp_path)
    with pytest.raises(ZooArgumentError, match="tiny-qwen3 is a file, not a directory"):
        make_checkpoint("llama", tmp_path / "tiny-qwen3", hf_cache=True)
    with pytest.raises(ZooArgumentError, match="lies under .*tiny-qwen3, which is a file"):
        make_checkpoint("llama", tmp_path / "tiny-qwen3" / "sub")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_hf_cache_builds_add_to_a_cache_and_replace_nothing(tmp_path):
    """The hub layout carries no marker (a snapshot holds the model's files only); it adds blobs,
    a snapshot and refs/main, and a repo folder in the wrong shape is refused."""
    from mlxbun.zoo.common import MARKER

    (tmp_path / "NOTES.txt").write_text("mine")
    snap = make_checkpoint("llama", tmp_path, hf_cache=True)
    assert not (snap / MARKER).exists()
    (snap.parent / "NOTES.txt").write_text("also mine")
    assert make_checkpoint("llama", tmp_path, hf_cache=True) == snap
    assert (tmp_path / "NOTES.txt").read_text() == "mine" and (snap.parent / "NOTES.txt").is_file()
    repo = tmp_path / "models--mlxbun--tiny-phi"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").mkdir()
    with pytest.raises(ZooArgumentError, match=r"refs/main exists and is not a file"):
        make_checkpoint("phi", tmp_path, hf_cache=True)
