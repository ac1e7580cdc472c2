"""The parity machinery on tiny mlx-lm checkpoints: adapter, oracle driver, gate, localization, manifests."""

import hashlib
import json
import math
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2, gemma3_text, llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxbun.config import TextConfig, load_model_config
from mlxbun.errors import ConfigError, LoadError, MlxbunError
from mlxbun.models.mlxlm import MlxLmRuntimeModel, load_mlxlm
from mlxbun.models.runtime import RuntimeModel
from mlxbun.parity.compare import bit_equal, max_abs_diff
from mlxbun.parity.gate import gate, second_prompt
from mlxbun.parity.localize import first_divergence
from mlxbun.parity.manifest import (
    ManifestError,
    config_fingerprint,
    load_logit_blobs,
    read_manifest,
    save_logit_blobs,
    write_manifest,
)
from mlxbun.parity.oracle import (
    default_prompt_ids,
    repeated_tokens,
    run_oracle,
    run_trajectory,
    varied_prompt_ids,
)
from tests.conftest import nan_weight_copy

BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
ARCHS = {
    "llama": (llama, dict(BASE, model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama_tied": (llama, dict(BASE, model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # layer 0 slides over a 16-token window (RotatingKVCache), layer 1 is global.
    "gemma3_text": (gemma3_text, dict(BASE, model_type="gemma3_text", head_dim=16, rms_norm_eps=1e-6,
                                      sliding_window=16, sliding_window_pattern=2)),
    # final logit softcap in the head.
    "gemma2": (gemma2, dict(BASE, model_type="gemma2", head_dim=16, rms_norm_eps=1e-6,
                            final_logit_softcapping=5.0)),
}
PROMPT = default_prompt_ids(512, length=40)
STEPS = 16


def _build(module, config: dict, directory: Path, seed: int) -> Path:
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    directory.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlxlm-ckpts")
    return {name: _build(mod, cfg, root / name, seed) for seed, (name, (mod, cfg)) in enumerate(ARCHS.items())}


def _perturbed(path: Path, param: str, delta: float = 1e-3) -> MlxLmRuntimeModel:
    m = load_mlxlm(path)
    w = dict(tree_flatten(m.module.parameters()))[param]
    m.module.load_weights([(param, w + delta)], strict=False)
    return m


# ------------------------------------------------------------------ adapter


@pytest.mark.parametrize("arch", list(ARCHS))
def test_adapter_is_a_runtime_model(ckpt, arch):
    m = load_mlxlm(ckpt[arch])
    assert isinstance(m, RuntimeModel)
    assert isinstance(m.config, TextConfig) and m.profile is None
    assert m.model_type == ARCHS[arch][1]["model_type"]
    file_tensors = mx.load(str(ckpt[arch] / "model.safetensors"))
    assert m.weights_bytes == sum(v.nbytes for v in file_tensors.values())
    kinds = [type(c) for c in m.make_cache()]
    assert kinds == ([RotatingKVCache, KVCache] if arch == "gemma3_text" else [KVCache, KVCache])
    with pytest.raises(MlxbunError, match="kv_bits"):
        m.make_cache(kv_bits=4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hidden_logits_split_is_bit_exact(ckpt, arch):
    m = load_mlxlm(ckpt[arch])
    x, step = mx.array([PROMPT]), mx.array([[PROMPT[0]]])
    c1, c2 = m.make_cache(), m.make_cache()
    full = [m(x, cache=c1), m(step, cache=c1)]
    h = m.forward_hidden(x, cache=c2)
    assert h.shape == (1, len(PROMPT), 64)
    split = [m.logits_from_hidden(h), m.logits_from_hidden(m.forward_hidden(step, cache=c2))]
    for a, b in zip(full, split):
        assert a.dtype == b.dtype and mx.array_equal(a, b)
    if arch == "gemma2":  # the arch's own head ran: softcapped, unlike the bare tied projection
        raw = m.module.model.embed_tokens.as_linear(h)
        assert mx.max(mx.abs(split[0])).item() <= 5.0 < mx.max(mx.abs(raw)).item()


def test_load_errors_name_the_culprit(tmp_path, ckpt):
    with pytest.raises(LoadError, match="nowhere"):
        load_mlxlm(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_mlxlm(bad)
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text((ckpt["llama"] / "config.json").read_text())
    weights = mx.load(str(ckpt["llama"] / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    mx.save_safetensors(str(short / "model.safetensors"), weights)
    with pytest.raises(LoadError, match="up_proj"):
        load_mlxlm(short)


# ------------------------------------------------------------------ oracle driver


def test_default_prompt_ids():
    a = default_prompt_ids(512)
    assert a == default_prompt_ids(512, length=40, seed=0) and len(a) == 40
    assert all(128 <= t < 384 for t in a) and len(set(a)) > 20
    assert default_prompt_ids(512, seed=1) != a
    assert not set(default_prompt_ids(512, exclude=a[:5])) & set(a[:5])
    assert default_prompt_ids(262144)[:3] != a[:3]


def test_trajectory_shape_and_greedy_ids(ckpt):
    m = load_mlxlm(ckpt["gemma3_text"])
    t = run_trajectory(m, PROMPT, decode_steps=4)
    assert t.prefill_logits.shape == (1, 40, 512) and t.dtype == "float32"
    assert len(t.step_logits) == 5 and len(t.greedy_ids) == 5 and t.prompt_ids == PROMPT
    assert [int(mx.argmax(s[0]).item()) for s in t.step_logits] == t.greedy_ids
    assert mx.array_equal(t.step_logits[0], t.prefill_logits[:, -1, :])
    again = run_oracle(ckpt["gemma3_text"], PROMPT, decode_steps=4)
    assert again.greedy_ids == t.greedy_ids
    assert all(mx.array_equal(a, b) for a, b in zip(again.step_logits, t.step_logits))
    b = run_trajectory(m, [PROMPT, second_prompt(PROMPT)], decode_steps=2)
    assert b.batched and b.prefill_logits.shape == (2, 40, 512) and [len(r) for r in b.greedy_ids] == [3, 3]
    with pytest.raises(MlxbunError, match="equal length"):
        run_trajectory(m, [PROMPT, PROMPT[:5]])


# ------------------------------------------------------------------ the gate


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_gate_passes_a_model_against_itself(ckpt, arch):
    r = gate(load_mlxlm(ckpt[arch]), load_mlxlm(ckpt[arch]), PROMPT, decode_steps=STEPS)
    assert r.verdict == "pass", r.reason
    assert r.trajectory_equal and r.batch2_equal is True
    assert r.max_abs_diff == 0.0 and r.per_step_max_abs_diff == [0.0] * (STEPS + 1)
    assert r.first_mismatch_step is None and r.first_divergence is None
    assert r.greedy_ids == r.candidate_greedy_ids and len(r.greedy_ids) == STEPS + 1


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_mlp_perturbation_is_localized(ckpt, arch):
    cand = _perturbed(ckpt[arch], "model.layers.1.mlp.down_proj.weight")
    r = gate(cand, load_mlxlm(ckpt[arch]), PROMPT, decode_steps=STEPS)
    assert r.verdict == "fail" and not r.trajectory_equal
    assert r.first_mismatch_step == 0 and r.max_abs_diff > 0
    d = r.first_divergence
    assert (d.path, d.substep, d.layer_index, d.step, d.kind) == ("model.layers.1.mlp", "mlp", 1, 0, "numeric")
    assert d.max_abs_diff > 0 and d.shape_a == d.shape_b == (1, 40, 64) and d.dtype_a == d.dtype_b == "float32"
    assert "model.layers.1.mlp" in r.reason


@pytest.mark.parametrize("layer", [0, 1])
def test_attention_perturbation_is_localized(ckpt, layer):
    cand = _perturbed(ckpt["llama"], f"model.layers.{layer}.self_attn.q_proj.weight")
    r = gate(cand, load_mlxlm(ckpt["llama"]), PROMPT, decode_steps=2)
    d = r.first_divergence
    assert r.verdict == "fail"
    assert (d.path, d.substep, d.layer_index) == (f"model.layers.{layer}.self_attn", "attention", layer)


def test_decode_only_divergence_is_localized_at_its_step(ckpt):
    class WideWindow(MlxLmRuntimeModel):
        """A cache bug: the sliding layer keeps 8 positions, fewer than the model's 16-token window."""

        def make_cache(self, **kv):
            return [RotatingKVCache(max_size=8), KVCache()]

    path = ckpt["gemma3_text"]
    cand = WideWindow(load_mlxlm(path).module)
    r = gate(cand, load_mlxlm(path), PROMPT, decode_steps=4)
    assert r.verdict == "fail" and r.first_mismatch_step == 1
    assert r.per_step_max_abs_diff[0] == 0.0 and r.per_step_max_abs_diff[1] > 0
    d = r.first_divergence
    assert (d.path, d.step, d.layer_index, d.substep) == ("model.layers.0.self_attn", 1, 0, "attention")


def test_batch2_only_divergence_and_logits_fallback(ckpt):
    class BatchBug(MlxLmRuntimeModel):
        def __call__(self, ids, cache=None):
            out = super().__call__(ids, cache)
            return out + 1e-3 if out.shape[0] == 2 else out

    path = ckpt["llama"]
    r = gate(BatchBug(load_mlxlm(path).module), load_mlxlm(path), PROMPT, decode_steps=2)
    assert r.trajectory_equal and r.batch2_equal is False and r.verdict == "fail"
    assert r.first_divergence.path == "logits" and r.first_divergence.substep == "head"
    assert r.first_divergence.shape_a == (2, 40, 512) and "batch-2" in r.reason


def test_structural_divergence(ckpt, tmp_path):
    # Same weights for layers 0-1, but the candidate has a third block: reported as recorded on one side.
    cfg = dict(ARCHS["llama"][1], num_hidden_layers=3)
    deeper = _build(llama, cfg, tmp_path / "deeper", seed=9)
    cand = load_mlxlm(deeper)
    cand.module.load_weights(str(ckpt["llama"] / "model.safetensors"), strict=False)
    d = first_divergence(cand, load_mlxlm(ckpt["llama"]), PROMPT[:8])
    assert d.kind == "structural" and d.path == "model.layers.2.input_layernorm"
    assert d.layer_index == 2 and d.shape_b is None and d.shape_a == (1, 8, 64)


# ------------------------------------------------------------------ non-finite logits


def test_nan_is_never_bit_equal():
    nan = mx.array([1.0, float("nan")])
    assert not bit_equal(nan, nan) and mx.isnan(mx.array(max_abs_diff(nan, nan))).item()
    inf = mx.array([1.0, float("inf")])
    assert not bit_equal(inf, inf)
    ok = mx.array([1.0, 2.0])
    assert bit_equal(ok, ok) and max_abs_diff(ok, ok) == 0.0


def test_nan_weight_checkpoint_fails_on_both_sides_and_names_where(ckpt, tmp_path):
    """The same NaN-weight checkpoint on both sides used to pass (NaN == NaN): now it fails at the
    prefill, says the logits are not finite on both sides, and localizes the NaN's first module."""
    bad = nan_weight_copy(ckpt["llama"], tmp_path / "nan", "model.layers.1.mlp.down_proj.weight")
    r = gate(load_mlxlm(bad), load_mlxlm(bad), PROMPT, decode_steps=4)
    assert r.verdict == "fail" and not r.trajectory_equal and r.first_mismatch_step == 0
    assert "prefill logits are not finite (NaN/inf) on the candidate and oracle" in r.reason
    assert math.isnan(r.max_abs_diff) and math.isnan(r.per_step_max_abs_diff[0])
    assert r.per_step_max_abs_diff[1:] == [None] * 4
    d = r.first_divergence
    assert (d.path, d.layer_index, d.step, d.kind, d.nonfinite) == (
        "model.layers.1.mlp", 1, 0, "nonfinite", "candidate and oracle")
    assert "model.layers.1.mlp (step 0, mlp, layer 1): non-finite values" in r.reason


def test_nan_weight_on_one_side_names_that_side(ckpt, tmp_path):
    bad = nan_weight_copy(ckpt["gemma3_text"], tmp_path / "nan", "model.layers.0.self_attn.o_proj.weight")
    r = gate(load_mlxlm(ckpt["gemma3_text"]), load_mlxlm(bad), PROMPT, decode_steps=2)
    assert r.verdict == "fail" and "prefill logits are not finite (NaN/inf) on the oracle" in r.reason
    d = r.first_divergence
    assert (d.path, d.kind, d.nonfinite) == ("model.layers.0.self_attn", "nonfinite", "oracle")


def test_nan_logits_in_a_decode_step_fail_at_that_step(ckpt):
    class NanAtStep2(MlxLmRuntimeModel):
        """A head bug that shows only in the second decode step (cache offset prompt + 2)."""

        def __call__(self, ids, cache=None):
            out = super().__call__(ids, cache)
            return out * float("nan") if cache[0].offset == len(PROMPT) + 2 else out

    path = ckpt["llama"]
    r = gate(NanAtStep2(load_mlxlm(path).module), load_mlxlm(path), PROMPT, decode_steps=4)
    assert r.verdict == "fail" and r.first_mismatch_step == 2
    assert r.per_step_max_abs_diff[:2] == [0.0, 0.0] and math.isnan(r.per_step_max_abs_diff[2])
    assert "decode step 2 logits are not finite (NaN/inf) on the candidate" in r.reason
    d = r.first_divergence  # every tapped module is finite: the head's NaN is reported at the logits
    assert (d.path, d.step, d.kind, d.nonfinite) == ("logits", 2, "nonfinite", "candidate")


# ------------------------------------------------------------------ one-token trajectories


def test_repeated_tokens():
    assert repeated_tokens([5, 5, 5]) == [5] and repeated_tokens([5, 6, 5]) is None
    assert repeated_tokens([[5, 5], [7, 7]]) == [5, 7] and repeated_tokens([[5, 5], [7, 8]]) is None


def test_gate_warns_when_the_oracle_repeats_one_token(ckpt):
    class Stuck(MlxLmRuntimeModel):
        """Always predicts id 7 (a model that has collapsed onto one token)."""

        def __call__(self, ids, cache=None):
            out = super().__call__(ids, cache)
            return out + 1e4 * (mx.arange(out.shape[-1]) == 7)

    path = ckpt["llama"]
    r = gate(Stuck(load_mlxlm(path).module), Stuck(load_mlxlm(path).module), PROMPT, decode_steps=3)
    assert r.verdict == "pass" and r.greedy_ids == [7] * 4
    assert r.warnings and "one token repeated (7)" in r.warnings[0] and "warning:" in r.reason
    assert gate(load_mlxlm(path), load_mlxlm(path), PROMPT, decode_steps=3).warnings == []


def test_varied_prompt_ids_skips_seeds_whose_trajectory_repeats_one_token(ckpt):
    class StuckOnPrompt(MlxLmRuntimeModel):
        """Collapses onto id 7 after a prefill of the seed-0 prompt, and only then."""

        stuck = False

        def __call__(self, ids, cache=None):
            if ids.shape[1] > 1:  # a prefill
                self.stuck = ids[0].tolist() == PROMPT
            out = super().__call__(ids, cache)
            return out + 1e4 * (mx.arange(out.shape[-1]) == 7) if self.stuck else out

    m = StuckOnPrompt(load_mlxlm(ckpt["llama"]).module)
    prompt, run = varied_prompt_ids(m, 512, decode_steps=3, tries=1)
    assert prompt == PROMPT and run.greedy_ids == [7] * 4  # no other seed allowed: seed 0 kept
    prompt, run = varied_prompt_ids(m, 512, decode_steps=3)
    assert prompt == default_prompt_ids(512, seed=1) and repeated_tokens(run.greedy_ids) is None
    r = gate(m, m, prompt, decode_steps=3, oracle_trajectory=run)  # the oracle's run is reused
    assert r.verdict == "pass" and r.oracle_trajectory is run and r.warnings == []
    with pytest.raises(MlxbunError, match="oracle_trajectory"):
        gate(m, m, PROMPT, decode_steps=3, oracle_trajectory=run)


def test_gate_accepts_bare_mlx_lm_modules(ckpt):
    a, b = load_mlxlm(ckpt["llama_tied"]), load_mlxlm(ckpt["llama_tied"])
    r = gate(a.module, b.module, PROMPT[:20], decode_steps=2)
    assert r.verdict == "pass" and r.max_abs_diff == 0.0
    assert first_divergence(a.module, b.module, PROMPT[:20], r.greedy_ids[:2]) is None


# ------------------------------------------------------------------ manifests and blobs


@pytest.fixture(scope="module")
def gate_result(ckpt):
    return gate(load_mlxlm(ckpt["llama"]), load_mlxlm(ckpt["llama"]), PROMPT, decode_steps=3)


def test_manifest_round_trip(ckpt, gate_result, tmp_path):
    path = tmp_path / "zoo-llama-float32-parity.json"
    cfg = load_model_config(ckpt["llama"])
    written = write_manifest(path, target="zoo:llama", checkpoint=ckpt["llama"], config=cfg, result=gate_result)
    got = read_manifest(path)
    assert got == written
    assert (got.model_type, got.dtype, got.target) == ("llama", "float32", "zoo:llama")
    assert got.prompt_ids == PROMPT and got.greedy_ids == gate_result.greedy_ids and got.decode_steps == 3
    assert got.gate["verdict"] == "pass" and got.gate["max_abs_diff"] == 0.0
    assert got.environment["mlx"] == mx.__version__ and got.environment["mlx_lm"] == "0.32.2"
    raw = json.loads((ckpt["llama"] / "config.json").read_text())
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert got.config_fingerprint == "sha256:" + hashlib.sha256(canon.encode()).hexdigest()
    assert config_fingerprint({k: raw[k] for k in reversed(list(raw))}) == got.config_fingerprint
    assert config_fingerprint(dict(raw, vocab_size=513)) != got.config_fingerprint
    assert json.dumps(PROMPT) in path.read_text()  # ids on one line


def _mutations():
    def drop(section, key):
        return lambda d: d[section].pop(key)

    def put(section, key, value):
        return lambda d: d[section].__setitem__(key, value) if section else d.__setitem__(key, value)

    return [
        ("identity.model_type", drop("identity", "model_type")),
        ("identity.config_fingerprint", put("identity", "config_fingerprint", "md5:abc")),
        ("trajectory.greedy_ids", put("trajectory", "greedy_ids", [1, 2])),
        ("trajectory.prompt_ids", put("trajectory", "prompt_ids", [1, "two"])),
        ("trajectory.decode_steps", put("trajectory", "decode_steps", -1)),
        ("environment.mlx_lm", drop("environment", "mlx_lm")),
        ("schema", put(None, "schema", "mlxbun-parity/0")),
        ("created", put(None, "created", "yesterday")),
        ("gate.verdict", lambda d: d["gate"].__setitem__("verdict", "maybe")),
        ("trajectory", lambda d: d.pop("trajectory")),
    ]


@pytest.mark.parametrize("field,mutate", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_manifest_names_file_and_field(ckpt, gate_result, tmp_path, field, mutate):
    path = tmp_path / "m-parity.json"
    write_manifest(path, checkpoint=ckpt["llama"], config=load_model_config(ckpt["llama"]), result=gate_result)
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=f"m-parity.json: field '{field}'"):
        read_manifest(path)


def test_unreadable_manifests(tmp_path):
    p = tmp_path / "x-parity.json"
    with pytest.raises(ManifestError, match="no such manifest"):
        read_manifest(p)
    p.write_text('{"schema": ')
    with pytest.raises(ManifestError, match=r"x-parity.json: not valid JSON \(line 1"):
        read_manifest(p)
    p.write_text("[1, 2]")
    with pytest.raises(ManifestError, match="field '<root>'"):
        read_manifest(p)
    with pytest.raises(ManifestError, match="needs prompt_ids"):
        write_manifest(p, config={"model_type": "llama"})


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_logit_blobs_round_trip(ckpt, tmp_path, dtype):
    m = load_mlxlm(ckpt["llama"])
    m.module.set_dtype(dtype)
    t = run_trajectory(m, [PROMPT[:10], PROMPT[10:20]], decode_steps=2)
    file = save_logit_blobs(tmp_path / "blobs", t, prefix="zoo-llama")
    assert file.name == "zoo-llama-logits.safetensors"
    back = load_logit_blobs(tmp_path / "blobs", prefix="zoo-llama")
    assert (back.prompt_ids, back.greedy_ids, back.decode_steps, back.batched) == (
        t.prompt_ids, t.greedy_ids, 2, True)
    assert back.dtype == t.dtype == str(dtype).removeprefix("mlx.core.")
    assert back.prefill_logits.dtype == dtype and mx.array_equal(back.prefill_logits, t.prefill_logits)
    assert all(a.dtype == b.dtype and mx.array_equal(a, b) for a, b in zip(back.step_logits, t.step_logits))
    with pytest.raises(ManifestError, match="no such logit blob"):
        load_logit_blobs(tmp_path / "blobs" / "missing-logits.safetensors")


def test_rewriting_an_unchanged_manifest_leaves_the_file_alone(tmp_path):
    from mlxbun.parity.manifest import read_manifest, write_manifest

    cfg = {"model_type": "llama", "hidden_size": 64}
    path = tmp_path / "x-parity.json"
    kw = dict(config=cfg, target="zoo:x", model_type="llama", dtype="float32", prompt_ids=[1, 2, 3],
              greedy_ids=[4, 5], decode_steps=1, logits_dtype="float32")
    write_manifest(path, created="2026-01-01T00:00:00+00:00", **kw)
    before = path.read_bytes()
    write_manifest(path, created="2026-06-01T00:00:00+00:00", **kw)
    assert path.read_bytes() == before  # same content: the tracked golden does not churn
    write_manifest(path, created="2026-06-01T00:00:00+00:00", **{**kw, "greedy_ids": [4, 6]})
    assert read_manifest(path).greedy_ids == [4, 6]
