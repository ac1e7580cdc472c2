"""The L1 parity gate for every manifest entry, run live against mlx-lm 0.32.2."""

from pathlib import Path

import pytest

from mlxbun.parity.port import Target, port_one
from tests.universal_manifest import MANIFEST

CASES = [(e.arch, v) for e in MANIFEST.values() for v in e.variants]


@pytest.mark.parametrize("arch,variant", CASES, ids=[f"{a}-{v}" for a, v in CASES])
def test_gate_is_bit_exact(zoo, arch, variant):
    from mlxbun.names import ZOO_VARIANTS

    path = zoo(arch, **ZOO_VARIANTS[variant])
    res = port_one(Target(f"zoo:{arch}", Path(path), variant), decode_steps=16, prompt_len=40)
    assert res.verdict == "pass", f"{arch}/{variant}: {res.reason} first divergence: {res.first_divergence}"
    assert res.max_abs_diff == 0.0
    assert res.trajectory == "equal"
    assert res.first_divergence is None


def test_manifest_covers_every_descriptor():
    from mlxbun.config import MODEL_REMAPPING
    from mlxbun.models.universal.table import DESCRIPTORS
    from mlxbun.profile import L1_DEDICATED_TYPES
    from mlxbun.zoo.archs import get_arch

    mts = {get_arch(a).model_type or a for a in MANIFEST}  # mistral3-ministral3: a mistral3 config
    covered = {MODEL_REMAPPING.get(a, a) for a in mts}
    assert covered == set(DESCRIPTORS) | set(L1_DEDICATED_TYPES), (
        f"descriptors without a manifest entry: {sorted(set(DESCRIPTORS) - covered)}; "
        f"entries without a descriptor: {sorted(covered - set(DESCRIPTORS))}"
    )


def test_every_mlx_lm_model_file_is_covered_or_explained():
    import mlx_lm.models as models_pkg

    from mlxbun.models.universal.not_covered import INFRASTRUCTURE_FILES, NOT_COVERED
    from mlxbun.models.universal.table import DESCRIPTORS
    from mlxbun.profile import L1_DEDICATED_TYPES

    files = {p.stem for p in Path(models_pkg.__file__).parent.glob("*.py") if p.stem != "__init__"}
    arch_files = files - set(INFRASTRUCTURE_FILES)
    covered = set(DESCRIPTORS) | set(L1_DEDICATED_TYPES)  # rows and dedicated ports held to mlx-lm
    unexplained = sorted(arch_files - covered - set(NOT_COVERED))
    assert not unexplained, f"mlx-lm model files neither covered nor explained: {unexplained}"
    assert not covered & set(NOT_COVERED)
    assert all(len(reason) > 10 for reason in NOT_COVERED.values())


def test_each_entry_opens_on_the_graph_it_expects():
    """`expect_graph`: the graph open_model resolves for the entry's zoo config (its profile)."""
    from mlxbun.config import config_from_dict
    from mlxbun.profile import resolve_model_profile
    from mlxbun.zoo import tiny_config

    for arch, entry in MANIFEST.items():
        profile = resolve_model_profile(config_from_dict(tiny_config(arch)))
        assert profile.execution.graph == entry.expect_graph, arch
        assert str(profile.fidelity).startswith("L1"), arch
