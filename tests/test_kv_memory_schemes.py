"""The KV-memory bench's schemes: the list on its command line, and TurboQuant widths and splits
of the KV grammar (turboquant3.5,keys=4) beside its fixed schemes (the decode itself: on the H200)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxbun.bench.kv_bytes import split_schemes
from mlxbun.bench.kv_memory import _convert, run_kv_memory
from mlxbun.cache.turboquant import TurboQuantKVCache
from mlxbun.errors import MlxbunError
from mlxbun.factory import open_model


@pytest.mark.parametrize("text, schemes", [
    ("fp16,q8,q4", ["fp16", "q8", "q4"]),
    ("fp16,turboquant3.5,keys=4,q4", ["fp16", "turboquant3.5,keys=4", "q4"]),
    ("turboquant:keys=5,values=3, turboquant3", ["turboquant:keys=5,values=3", "turboquant3"]),
    ("q4,keys=4", ["q4", "keys=4"]),  # an option of no TurboQuant scheme stays a (bad) scheme of its own
])
def test_split_schemes_keeps_a_turboquant_schemes_options_with_it(text, schemes):
    assert split_schemes(text) == schemes


@pytest.mark.parametrize("scheme, widths", [("turboquant3.5", (3, 4)), ("turboquant3.5,keys=4", (4, 3)),
                                            ("turboquant:keys=5,values=3", (5, 3)), ("turboquant3", (3, 3))])
def test_turboquant_schemes_convert_to_their_widths(zoo, scheme, widths):
    model = open_model(zoo("llama", head_dim=32))
    caches = model.make_cache()
    model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    out = _convert(caches, scheme)
    assert all(isinstance(c, TurboQuantKVCache) and (c.key_bits, c.value_bits) == widths for c in out)


@pytest.mark.parametrize("scheme", ["q5", "turboquant3.5,keys=8", "keys=4", "turboquant2.25"])
def test_run_kv_memory_refuses_a_scheme_it_cannot_build_by_name(zoo, scheme):
    with pytest.raises(MlxbunError, match="unknown KV scheme"):
        run_kv_memory(open_model(zoo("llama", head_dim=32)), [8], ["fp16", scheme], decode=1)


def test_run_kv_memory_measures_a_turboquant_split(zoo):
    rows = run_kv_memory(open_model(zoo("llama", head_dim=32)), [16], ["fp16", "turboquant3.5,keys=4"], decode=2)
    assert [r.scheme for r in rows] == ["fp16", "turboquant3.5,keys=4"]
    assert 0 < rows[1].kv_bytes < rows[0].kv_bytes and all(r.decode_tps > 0 for r in rows)
