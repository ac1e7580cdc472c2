"""Profile resolution and validation (seed design §3)."""

import dataclasses
import json

import pytest
from transformers import LlamaConfig

from mlxbun import profile as P
from mlxbun.config import config_from_dict
from mlxbun.errors import UnsupportedModelError


def _llama_cfg(**over):
    d = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512).to_dict()
    d.update(over)
    return config_from_dict(d)


def test_generic_descriptor_resolves_to_l1_universal_dense():
    prof = P.resolve_model_profile(_llama_cfg())
    assert prof.execution.graph == "universal-dense"
    assert prof.execution.specialization == "generic"
    assert prof.fidelity == P.L1_MLX_LM
    assert prof.tier == "generic"
    assert P.validate_profile(prof) is prof


def test_remapped_type_resolves_through_the_table():
    prof = P.resolve_model_profile(_llama_cfg(model_type="mistral"))
    assert prof.model_type == "llama"
    assert P.support_tier("mistral") == "generic"


def test_unknown_model_type_refuses_naming_supported_types():
    with pytest.raises(UnsupportedModelError) as e:
        P.resolve_model_profile(_llama_cfg(model_type="definitely_not_an_arch"))
    msg = str(e.value)
    assert "definitely_not_an_arch" in msg and "llama" in msg and "qwen3" in msg


def test_not_covered_type_refuses_with_its_documented_reason():
    from mlxbun.models.universal.not_covered import NOT_COVERED

    mt, reason = sorted(NOT_COVERED.items())[0]
    with pytest.raises(UnsupportedModelError) as e:
        P.resolve_model_profile(_llama_cfg(model_type=mt))
    assert mt in str(e.value) and reason in str(e.value)
    assert P.support_tier(mt) is None


def _hub_snapshot(tmp_path, cfg: dict):
    snap = tmp_path / "models--acme--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(cfg))
    return snap


def test_exact_artifact_profile_outranks_generic_and_refuses_on_mismatch(tmp_path, monkeypatch):
    from mlxbun.config import load_model_config

    cfg = _llama_cfg()
    snap = _hub_snapshot(tmp_path, dict(cfg.raw_full))
    loaded = load_model_config(snap)
    exact = dataclasses.replace(
        P.generic_profile("llama"), id="acme-tiny-exact",
        execution=P.Execution("safetensors", "universal-dense", "autoregressive", "artifact"),
        artifact_fingerprint="hf:acme/tiny@" + "a" * 40, config_fingerprint=loaded.fingerprint(),
    )
    monkeypatch.setitem(P.EXACT_PROFILES, exact.artifact_fingerprint, exact)
    assert P.resolve_model_profile(loaded, snap).id == "acme-tiny-exact"
    assert P.validate_profile(exact) is exact
    # Same artifact identity, different structure: refuse, never fall back to generic.
    (snap / "config.json").write_text(json.dumps({**dict(cfg.raw_full), "num_hidden_layers": 3}))
    with pytest.raises(P.ProfileError, match="acme-tiny-exact"):
        P.resolve_model_profile(load_model_config(snap), snap)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(fidelity=P.Fidelity("L1", "mlx-vlm", "bit-exact")), "L1 cannot be backed"),
        (dict(fidelity=P.Fidelity("L2", "mlx-vlm", "measured")), "means 'bit-exact'"),
        (dict(fidelity=P.Fidelity("L3", "mlx-lm", "measured")), "L3 cannot be backed"),
        (dict(execution=P.Execution("safetensors", "universal-dense", "diffusion", "generic")), "runs only under loop"),
        (dict(required_capabilities=frozenset({"safetensors", "autoregressive"})), "undeclared capabilities"),
        (dict(required_capabilities=frozenset({"safetensors", "autoregressive", "universal-dense-graph", "vision-sidecar"})),
         "lacks: ['vision-sidecar']"),
        (dict(execution=P.Execution("colibri", "universal-dense", "autoregressive", "generic")), "unknown execution"),
        (dict(artifact_fingerprint="hf:a/b@" + "0" * 40), "only artifact profiles"),
    ],
)
def test_validate_profile_refuses_inconsistent_profiles(change, message):
    bad = dataclasses.replace(P.generic_profile("llama"), **change)
    with pytest.raises(P.ProfileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        P.validate_profile(bad)


def test_supported_model_types_lists_every_descriptor_as_generic():
    from mlxbun.models.universal.table import DESCRIPTORS

    tiers = P.supported_model_types()
    assert set(DESCRIPTORS) <= set(tiers)
    assert len(DESCRIPTORS) >= 20
    assert all(tiers[t] == "generic" for t in DESCRIPTORS)
