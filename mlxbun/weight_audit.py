"""Weight audit: the tensors a graph consumes against those a checkpoint holds.

Works from safetensors headers alone (a dry run, given a `WeightIndex`), from loaded
arrays, or from bare names; tensors an architecture deliberately ignores are named by
`DropRule`s, and everything else missing, unconsumed or mismatched is reported. Headers
cannot show values: `check_values` reads them and fails a report on NaN/inf tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, NamedTuple

from mlxbun.errors import LoadError
from mlxbun.weights import TensorInfo, WeightIndex, dtype_name, name_list


@dataclass(frozen=True)
class DropRule:
    """Present tensors an arch deliberately ignores (regex searched in the name, or a predicate)."""

    pattern: str | re.Pattern | Callable[[str], bool]
    reason: str
    _match: Callable[[str], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if callable(self.pattern) and not isinstance(self.pattern, re.Pattern):
            match = self.pattern
        else:
            regex = re.compile(self.pattern)
            match = lambda name: regex.search(name) is not None  # noqa: E731
        object.__setattr__(self, "_match", match)

    def matches(self, name: str) -> bool:
        return bool(self._match(name))


class TensorSpec(NamedTuple):
    shape: tuple[int, ...] | None  # None: not known / not checked
    dtype: str | None  # canonical name (see dtype_name)

    def __str__(self) -> str:
        """What is known: "(64,) float32", "(64,)" (any dtype), "uint32" (any shape), or "any"."""
        known = [str(part) for part in (self.shape, self.dtype) if part is not None]
        return " ".join(known) or "any"


class Mismatch(NamedTuple):
    name: str
    expected: TensorSpec
    found: TensorSpec


@dataclass(frozen=True)
class AuditReport:
    consumed: tuple[str, ...]
    dropped: Mapping[str, str]  # name -> reason
    missing: tuple[str, ...]
    unconsumed: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    source: str = "weights"
    values_checked: bool = False  # False: from headers (or names) alone, NaN/inf unseen
    nonfinite: tuple[str, ...] = ()  # floating tensors holding NaN or inf (when values_checked)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unconsumed or self.mismatched or self.nonfinite)

    def describe(self) -> str:
        if self.ok:
            values = ", values finite" if self.values_checked else ""
            return f"{self.source}: {len(self.consumed)} consumed, {len(self.dropped)} dropped, all match{values}"
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing: {name_list(self.missing)}")
        if self.unconsumed:
            parts.append(f"{len(self.unconsumed)} unconsumed: {name_list(self.unconsumed)}")
        if self.mismatched:
            shown = [f"{m.name} (expected {m.expected}, found {m.found})" for m in self.mismatched]
            parts.append(f"{len(self.mismatched)} mismatched: {name_list(shown)}")
        if self.nonfinite:
            parts.append(f"{len(self.nonfinite)} holding NaN/inf: {name_list(self.nonfinite)}")
        mismatch = self.missing or self.unconsumed or self.mismatched
        fault = "do not match the graph" if mismatch else "fail the value check"
        return f"{self.source} {fault}: " + "; ".join(parts)


def _spec_of(value: Any) -> TensorSpec | None:
    if isinstance(value, TensorInfo):
        return TensorSpec(value.shape, dtype_name(value.dtype))
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return TensorSpec(tuple(value.shape), dtype_name(value.dtype))
    return None


class WeightAudit:
    """Diff the tensors a graph consumes against those present, minus drop rules.

    Works from headers alone (a dry run) when given a `WeightIndex`; also takes
    a dict of loaded arrays, or bare names (then only presence is checked).
    """

    def __init__(self, index_or_names: WeightIndex | Mapping[str, Any] | Iterable[str],
                 drop_rules: Sequence[DropRule] = ()) -> None:
        if isinstance(index_or_names, WeightIndex):
            self._source = f"weights in {index_or_names.root}"
            items = index_or_names.tensors.items()
        elif isinstance(index_or_names, Mapping):
            self._source, items = "weights", index_or_names.items()
        else:
            self._source, items = "weights", ((n, None) for n in index_or_names)
        self._present: dict[str, TensorSpec | None] = {n: _spec_of(v) for n, v in items}
        self._rules = tuple(drop_rules)
        self._expected: dict[str, TensorSpec] = {}

    def expect(self, name: str, shape: Sequence[int] | None = None, dtype: Any = None) -> None:
        """Record that the graph consumes `name`; shape/dtype None means unchecked."""
        spec = TensorSpec(None if shape is None else tuple(shape), None if dtype is None else dtype_name(dtype))
        if self._expected.get(name, spec) != spec:
            raise ValueError(f"{name!r} expected twice with different specs: {self._expected[name]} vs {spec}")
        self._expected[name] = spec

    def expect_params(self, params: Mapping[str, Any], *, dtype: bool = True) -> None:
        """Expect every array of a (possibly nested, as `Module.parameters()`) dict.

        dtype=False checks shapes only, as mlx-lm's load_weights does (it keeps
        the checkpoint's dtype rather than the graph's init dtype).
        """
        from mlx.utils import tree_flatten

        for name, a in tree_flatten(params):
            self.expect(name, a.shape, a.dtype if dtype else None)

    def finish(self) -> AuditReport:
        consumed, missing, mismatched = [], [], []
        for name, want in self._expected.items():
            if name not in self._present:
                missing.append(name)
                continue
            consumed.append(name)
            have = self._present[name]
            if have is None:
                continue
            if (want.shape is not None and want.shape != have.shape) or (
                want.dtype is not None and want.dtype != have.dtype
            ):
                mismatched.append(Mismatch(name, want, have))
        dropped, unconsumed = {}, []
        for name in self._present:
            if name in self._expected:
                continue
            rule = next((r for r in self._rules if r.matches(name)), None)
            if rule is None:
                unconsumed.append(name)
            else:
                dropped[name] = rule.reason
        return AuditReport(
            consumed=tuple(sorted(consumed)),
            dropped=MappingProxyType(dict(sorted(dropped.items()))),
            missing=tuple(sorted(missing)),
            unconsumed=tuple(sorted(unconsumed)),
            mismatched=tuple(sorted(mismatched, key=lambda m: m.name)),
            source=self._source,
        )

    def check(self) -> AuditReport:
        """The report, or a LoadError naming missing / unconsumed / mismatched tensors."""
        report = self.finish()
        if not report.ok:
            raise LoadError(report.describe())
        return report


def check_values(report: AuditReport, index: WeightIndex) -> AuditReport:
    """`report` with the values of `index`'s floating tensors read (all but the dropped ones,
    one file at a time): a LoadError naming the tensors that hold NaN or inf, else the report
    marked `values_checked`."""
    import mlx.core as mx

    names = [n for n, t in index.tensors.items()
             if n not in report.dropped and t.mx_dtype is not None and mx.issubdtype(t.mx_dtype, mx.floating)]
    bad = []
    for file in index.files:
        arrays = index.load([n for n in names if index.tensors[n].file == file])
        bad += [n for n, a in arrays.items() if not mx.all(mx.isfinite(a)).item()]
    checked = replace(report, values_checked=True, nonfinite=tuple(sorted(bad)))
    if not checked.ok:
        raise LoadError(checked.describe())
    return checked
