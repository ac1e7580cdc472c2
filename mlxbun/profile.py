"""Model profiles: what a checkpoint is, how mlxbun runs it, and how faithful that is.

One immutable `ModelProfile` is resolved per load, before any weight is opened
(seed design §3). Resolution order: exact artifact profile (an immutable HF
snapshot identity) > family profile > generic descriptor > refusal naming the
supported model_types. A matched profile that does not fit the checkpoint
refuses; nothing downgrades to a weaker tier.

A profile declares construction only (loader, graph, loop, specialization) and
its fidelity: L1 = bit-exact vs mlx-lm, L2 = bit-exact vs another shipped
reference (mlx-vlm, mlx-optiq), L3 = measured only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from mlxbun.errors import UnsupportedModelError

if TYPE_CHECKING:  # pragma: no cover
    from mlxbun.config import TextConfig

Level = Literal["L1", "L2", "L3"]
Tier = Literal["targeted", "generic"]

# What this engine can construct today. A profile requiring anything else refuses.
ENGINE_CAPABILITIES: frozenset[str] = frozenset(
    {
        "autoregressive",
        "diffusion",
        "diffusion-gemma-graph",
        "gemma3n-graph",
        "llada2-graph",
        "masked-diffusion",
        "safetensors",
        "universal-dense-graph",
    }
)

# The capabilities an execution composition implies (validate_profile checks them).
_LOADER_CAPS = {"safetensors": "safetensors"}
_LOOP_CAPS = {"autoregressive": "autoregressive", "diffusion": "diffusion", "masked-diffusion": "masked-diffusion"}
_GRAPH_CAPS = {
    "universal-dense": "universal-dense-graph",
    "diffusion-gemma": "diffusion-gemma-graph",
    "gemma3n": "gemma3n-graph",
    "llada2": "llada2-graph",
}
# Graphs that only make sense under one loop.
_GRAPH_LOOP = {"diffusion-gemma": "diffusion", "llada2": "masked-diffusion", "universal-dense": "autoregressive",
               "gemma3n": "autoregressive"}
# Which oracle may back which level.
_LEVEL_ORACLES = {"L1": {"mlx-lm"}, "L2": {"mlx-vlm", "mlx-optiq"}, "L3": {None}}
_LEVEL_BAR = {"L1": "bit-exact", "L2": "bit-exact", "L3": "measured"}


class ProfileError(UnsupportedModelError):
    """A profile is inconsistent, or does not match the checkpoint it was resolved for."""


@dataclass(frozen=True)
class Fidelity:
    level: Level
    oracle: str | None  # "mlx-lm", "mlx-vlm", "mlx-optiq" or None (measured only)
    bar: str  # "bit-exact" | "measured"

    def __str__(self) -> str:
        return f"{self.level} ({self.bar} vs {self.oracle})" if self.oracle else f"{self.level} ({self.bar})"


L1_MLX_LM = Fidelity("L1", "mlx-lm", "bit-exact")


@dataclass(frozen=True)
class Execution:
    loader: str  # "safetensors"
    graph: str  # "universal-dense", ...
    loop: str  # "autoregressive" | "diffusion"
    specialization: str  # "artifact" | "dedicated" | "generated" | "generic"


@dataclass(frozen=True)
class ModelProfile:
    id: str
    fidelity: Fidelity
    required_capabilities: frozenset[str]
    execution: Execution
    model_type: str
    artifact_fingerprint: str | None = None  # exact profiles only: hf:<org>/<repo>@<rev>
    config_fingerprint: str | None = None  # structural guard for an exact declaration

    @property
    def tier(self) -> Tier:
        return "generic" if self.execution.specialization == "generic" else "targeted"


@dataclass(frozen=True)
class FamilyProfile:
    """A targeted family: a predicate on the config picks a dedicated graph."""

    name: str
    matches: Callable[["TextConfig"], bool]
    build: Callable[["TextConfig"], ModelProfile]
    model_types: tuple[str, ...] = field(default=())


def _dedicated(model_type: str, graph: str, loop: str, oracle: str) -> FamilyProfile:
    """A dedicated graph for one model_type, held bit-exact to the reference that ships it: L1 when
    that is mlx-lm, else L2."""
    profile = ModelProfile(
        id=f"{graph}-dedicated",
        fidelity=Fidelity("L1" if oracle == "mlx-lm" else "L2", oracle, "bit-exact"),
        required_capabilities=frozenset({"safetensors", _LOOP_CAPS[loop], _GRAPH_CAPS[graph]}),
        execution=Execution("safetensors", graph, loop, "dedicated"),
        model_type=model_type,
    )
    return FamilyProfile(profile.id, lambda c: c.model_type == model_type, lambda c: profile, (model_type,))


# Exact artifact declarations, keyed by artifact fingerprint (hf:<org>/<repo>@<rev>).
EXACT_PROFILES: dict[str, ModelProfile] = {}
# Targeted families, tried in order before the generic descriptor table.
FAMILY_PROFILES: list[FamilyProfile] = [
    # mlx-lm cannot load these: the oracle is mlx-vlm 0.7.10 (tests/test_diffusion_gemma.py,
    # tests/test_masked_diffusion.py hold the graphs and loops to it).
    _dedicated("diffusion_gemma", "diffusion-gemma", "diffusion", "mlx-vlm"),
    _dedicated("llada2_moe", "llada2", "masked-diffusion", "mlx-vlm"),
    # mlx-lm runs it (L1): AltUp streams, per-layer inputs and a cache list shorter than the
    # layers do not fit the universal block (models/gemma3n/__init__.py says why)
    _dedicated("gemma3n", "gemma3n", "autoregressive", "mlx-lm"),
]

# Dedicated graphs held to mlx-lm (L1): `mlxbun port` gates them like the universal rows.
L1_DEDICATED_TYPES: tuple[str, ...] = tuple(
    t for fam in FAMILY_PROFILES if fam.build(None).fidelity.level == "L1" for t in fam.model_types)


def _generic_types() -> dict:
    from mlxbun.models.universal.table import DESCRIPTORS

    return DESCRIPTORS


def _not_covered() -> dict[str, str]:
    from mlxbun.models.universal.not_covered import NOT_COVERED

    return NOT_COVERED


def generic_profile(model_type: str) -> ModelProfile:
    return ModelProfile(
        id=f"universal-dense:{model_type}",
        fidelity=L1_MLX_LM,
        required_capabilities=frozenset({"safetensors", "autoregressive", "universal-dense-graph"}),
        execution=Execution("safetensors", "universal-dense", "autoregressive", "generic"),
        model_type=model_type,
    )


def supported_model_types() -> dict[str, Tier]:
    """Every model_type mlxbun can run, with its tier (targeted outranks generic)."""
    tiers: dict[str, Tier] = {t: "generic" for t in _generic_types()}
    for fam in FAMILY_PROFILES:
        for t in fam.model_types:
            tiers[t] = "targeted"
    return dict(sorted(tiers.items()))


def support_tier(model_type: str, repo_id: str | None = None) -> Tier | None:
    """"targeted", "generic" or None (unsupported) for a model_type (after remapping)."""
    from mlxbun.config import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(model_type, model_type)
    return supported_model_types().get(model_type)


def unsupported_reason(model_type: str) -> str:
    """Why a model_type is not supported (the documented reason when there is one)."""
    from mlxbun.config import MODEL_REMAPPING

    mapped = MODEL_REMAPPING.get(model_type, model_type)
    reason = _not_covered().get(mapped)
    known = ", ".join(supported_model_types())
    head = f"model_type '{model_type}'" + (f" (mlx-lm: '{mapped}')" if mapped != model_type else "")
    if reason:
        return f"{head} is not supported: {reason}. Supported model_types: {known}"
    return f"{head} is not supported. Supported model_types: {known}"


def resolve_model_profile(config: "TextConfig", path=None) -> ModelProfile:
    """Resolve the one profile for a checkpoint, before any weight is opened."""
    from mlxbun.snapshot_identity import artifact_fingerprint

    fingerprint = artifact_fingerprint(path) if path is not None else None
    if fingerprint and fingerprint in EXACT_PROFILES:
        exact = EXACT_PROFILES[fingerprint]
        if exact.config_fingerprint and exact.config_fingerprint != config.fingerprint():
            raise ProfileError(
                f"{fingerprint}: exact profile '{exact.id}' expects config fingerprint "
                f"{exact.config_fingerprint[:12]}, the checkpoint has {config.fingerprint()[:12]}; "
                "refusing rather than falling back"
            )
        if exact.model_type != config.model_type:
            raise ProfileError(
                f"{fingerprint}: exact profile '{exact.id}' is for model_type "
                f"'{exact.model_type}', the checkpoint declares '{config.model_type}'"
            )
        return exact
    for fam in FAMILY_PROFILES:
        if fam.matches(config):
            return fam.build(config)
    if config.model_type in _generic_types():
        return generic_profile(config.model_type)
    raise UnsupportedModelError(unsupported_reason(config.source_model_type))


def validate_profile(profile: ModelProfile, capabilities: frozenset[str] = ENGINE_CAPABILITIES) -> ModelProfile:
    """Refuse an inconsistent profile, or one this engine cannot construct."""
    fid, ex = profile.fidelity, profile.execution
    if fid.oracle not in _LEVEL_ORACLES.get(fid.level, ()):
        raise ProfileError(f"profile '{profile.id}': fidelity {fid.level} cannot be backed by oracle {fid.oracle!r}")
    if fid.bar != _LEVEL_BAR[fid.level]:
        raise ProfileError(f"profile '{profile.id}': fidelity {fid.level} means '{_LEVEL_BAR[fid.level]}', not '{fid.bar}'")
    if ex.graph in _GRAPH_LOOP and _GRAPH_LOOP[ex.graph] != ex.loop:
        raise ProfileError(f"profile '{profile.id}': graph '{ex.graph}' runs only under loop '{_GRAPH_LOOP[ex.graph]}', not '{ex.loop}'")
    if (ex.specialization == "artifact") != (profile.artifact_fingerprint is not None):
        raise ProfileError(f"profile '{profile.id}': only artifact profiles carry an artifact fingerprint")
    implied = {_LOADER_CAPS.get(ex.loader), _LOOP_CAPS.get(ex.loop), _GRAPH_CAPS.get(ex.graph)}
    if None in implied:
        raise ProfileError(f"profile '{profile.id}': unknown execution {ex}")
    undeclared = implied - profile.required_capabilities
    if undeclared:
        raise ProfileError(f"profile '{profile.id}': execution implies undeclared capabilities {sorted(undeclared)}")
    missing = profile.required_capabilities - capabilities
    if missing:
        raise ProfileError(f"profile '{profile.id}' needs engine capabilities this build lacks: {sorted(missing)}")
    return profile
