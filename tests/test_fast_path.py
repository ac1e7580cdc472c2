"""The fast path on the CPU: kernel dispatch and fallbacks, the swap, the compiled decode step,
the lever's flags and the drift it records. The CUDA kernel itself runs only on the H200
(`benchmarks/gpu_check.py`); here a float32 emulation of its arithmetic stands in where the
dispatch needs a kernel to call."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlxbun.fast.linear as fast_linear
import mlxbun.fast.path as fast_path_mod
from mlxbun import cli
from mlxbun.bench import run_bench
from mlxbun.bench.engines import shares_weights
from mlxbun.factory import open_model
from mlxbun.fast import CompiledDecoder, CompileGap, FastPathError, enable_fast
from mlxbun.fast import static_cache
from mlxbun.fast.fidelity import decode_fidelity
from mlxbun.zoo import archs as zoo_archs
from mlxbun.generate import stream_generate
from mlxbun.kernels import Gap, fast_quantized_matmul, kernel_gap
from mlxbun.kernels import qmv as qmv_mod
from mlxbun.kernels import tuning
from mlxbun.kernels.qmv import MAX_ROWS, input_gap, weight_gap
from mlxbun.models.mlxlm import load_mlxlm
from mlxbun.results import open_results
from mlxbun.tokenizer import load_tokenizer
from tests.decode_steps import PROMPT, step_beside_exact


def _weights(n=256, k=256, bits=4, group=64, dtype=mx.bfloat16):
    w = (mx.random.normal((n, k), key=mx.random.key(0)) * 0.02).astype(dtype)
    return mx.quantize(w, group_size=group, bits=bits)


def _emulated_qmv(x, w, scales, biases, group_size, bits, **_):
    """The kernel's sum, scale * sum(q x) + bias * sum(x) per group, in float32 (CPU stand-in)."""
    wf = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    return (x.astype(mx.float32) @ wf.T).astype(x.dtype)


# ------------------------------------------------------------------ kernel gaps


def test_the_kernel_refuses_a_cpu_with_its_reason():
    wq, s, b = _weights()
    x = mx.ones((1, 256), mx.bfloat16)
    gap = kernel_gap(x, wq, s, b, 64, 4)
    assert gap == Gap("no CUDA device (the kernel is CUDA only)")
    with pytest.raises(ValueError, match="no CUDA device"):
        fast_quantized_matmul(x, wq, s, b, 64, 4)


@pytest.mark.parametrize("bits,group,dtype,k,reason", [
    (3, 64, mx.bfloat16, 256, "3-bit weights"),
    (2, 32, mx.bfloat16, 256, "2-bit weights"),
    (4, 64, mx.float32, 256, "float32 scales"),
    (4, 64, mx.bfloat16, 320, "K % 128 == 0"),
])
def test_weight_gap_names_what_the_kernel_lacks(monkeypatch, bits, group, dtype, k, reason):
    monkeypatch.setattr(qmv_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(tuning, "MODE", "tuned")
    wq, s, b = _weights(k=k, bits=bits, group=group, dtype=dtype)
    gap = weight_gap(wq, s, b, group, bits)
    assert gap is not None and reason in gap.reason and not gap.by_design
    assert weight_gap(*_weights(), 64, 4) is None
    assert weight_gap(wq, s, None, group, bits) is not None  # no biases: not affine


def test_shapes_the_tuning_leaves_to_mlx_are_by_design(monkeypatch):
    monkeypatch.setattr(qmv_mod, "cuda_available", lambda: True)
    wq, s, b = _weights(n=1024, k=4096)
    gap = weight_gap(wq, s, b, 64, 4)  # off by default: in the decode step it lost to MLX's op
    assert gap.by_design and "GEMV kernel is off" in gap.reason
    monkeypatch.setattr(tuning, "MODE", "tuned")  # TUNED[(4, 1024, 4096)] is None: MLX's op was faster
    gap = weight_gap(wq, s, b, 64, 4)
    assert gap.by_design and "measured faster" in gap.reason


def test_input_gap_leaves_wide_inputs_to_mlx(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    wq, s, _ = _weights()
    assert input_gap(mx.ones((1, MAX_ROWS, 256), mx.bfloat16), wq, s) is None
    wide = input_gap(mx.ones((1, MAX_ROWS + 1, 256), mx.bfloat16), wq, s)
    assert wide.by_design and f"{MAX_ROWS + 1} rows" in wide.reason
    assert "bfloat16 scales" in input_gap(mx.ones((1, 256), mx.float32), wq, s).reason


# ------------------------------------------------------------------ the swap and the dispatch


@pytest.fixture
def emulated_kernel(monkeypatch):
    """The dispatch as on a CUDA device: every weight taken, inputs by width, the emulation run."""
    calls = []

    def launch(*args, **kw):
        calls.append(args[0].shape)
        return _emulated_qmv(*args, **kw)

    monkeypatch.setattr(fast_path_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(fast_linear, "weight_gap", lambda *a, **k: None)
    monkeypatch.setattr(fast_linear, "input_gap",
                        lambda x, w, s: Gap("wide", True) if x.size // x.shape[-1] > MAX_ROWS else None)
    monkeypatch.setattr(fast_linear, "launch_qmv", launch)
    return calls


def test_swap_keeps_the_arrays_and_the_exact_path(zoo, emulated_kernel):
    path = zoo("llama", quant=4)
    model, plain = open_model(path), open_model(path)
    model.update(plain.parameters())  # one set of arrays for both
    ids = mx.array([[1, 2, 3, 4, 5]])
    before = plain(ids)
    fast = enable_fast(model, compile_decode=False)
    assert fast.quantized_linears == sum(type(m) is nn.QuantizedLinear for _, m in plain.named_modules())
    assert shares_weights(model, plain)
    assert mx.array_equal(model(ids), before)  # switch off: nn.QuantizedLinear's own call
    assert not emulated_kernel
    with fast.on():
        wide = model(ids)  # 5 rows: wider than the kernel takes, so MLX's op, and nothing reported
    assert not emulated_kernel and mx.array_equal(wide, before) and not fast.switch.gaps
    with fast.on():
        model(ids[:, :MAX_ROWS])
    assert emulated_kernel and all(shape[-2] <= MAX_ROWS for shape in emulated_kernel)
    assert enable_fast(model) is fast  # one FastPath per model
    assert not fast.switch.enabled


def test_the_fast_path_refuses_mlx_lm_models(zoo):
    with pytest.raises(FastPathError, match="mlx-lm has no fast path"):
        enable_fast(load_mlxlm(zoo("llama")))


# ------------------------------------------------------------------ the compiled decode step


def _decode_both(path, steps=6, prompt=PROMPT):
    model = open_model(path)
    return (model, *step_beside_exact(model, lambda static: CompiledDecoder(model, static, room=steps), steps, prompt))


@pytest.mark.parametrize("arch,quant,dtype,scatter", [
    ("llama", None, "float32", False), ("llama", 4, "float32", False), ("qwen3", None, "bfloat16", False),
    ("qwen3_next", None, "float32", False), ("mamba2", None, "float32", False), ("lfm2", None, "float32", False),
    ("llama", None, "float32", True), ("qwen3", None, "bfloat16", True)])
def test_the_compiled_step_reproduces_the_exact_path_on_the_cpu(zoo, monkeypatch, arch, quant, dtype, scatter):
    # KV, gated-delta and SSM / conv states: on MLX's CPU backend the compiled step gives the exact
    # bits here (measured, not promised: on CUDA it drifts and the bench reports how much). `scatter`:
    # the K/V buffers take their rows by scatter (what buffers of 8 MiB and more do), not slice update.
    if scatter:
        monkeypatch.setattr(static_cache, "SCATTER_FROM_BYTES", 0)
    model, exact, static, dec, pairs = _decode_both(zoo(arch, quant=quant, dtype=dtype))
    assert all(mx.array_equal(e, f) for e, f in pairs)
    dec.write_back()
    y = mx.array([[11]])
    assert mx.array_equal(model(y, cache=exact), model(y, cache=static))  # the state came back whole


@pytest.mark.parametrize("prompt_len", [5, 20])  # the ring filled while decoding / already wrapped
def test_the_sliding_window_ring_decodes_what_the_rotating_cache_does(zoo, prompt_len):
    # gemma3_text's zoo window is 16 slots: 30 steps wrap the ring either way. The ring attends
    # over its slots in another order than RotatingKVCache: close, not equal (measured here).
    model, exact, static, dec, pairs = _decode_both(zoo("gemma3_text"), steps=30,
                                                    prompt=[(i * 7) % 50 + 1 for i in range(prompt_len)])
    assert {type(c).__name__ for c in static} == {"RotatingKVCache", "KVCache"}
    diffs = [mx.abs(e - f).max().item() for e, f in pairs]
    assert max(diffs) < 1e-4 and all(mx.array_equal(mx.argmax(e, -1), mx.argmax(f, -1)) for e, f in pairs)
    dec.write_back()
    y = mx.array([[11]])
    assert mx.abs(model(y, cache=exact) - model(y, cache=static)).max().item() < 1e-4


# graphs the compiled step refuses, and the words of the refusal: nemotron-nas's cache list holds a
# cache the model never writes; dbrx routes token by token through host lists (mlx-lm's loop)
_REFUSED = {"nemotron-nas": "layers hold different numbers of tokens",
            "dbrx": "does not trace with static caches"}


@pytest.mark.parametrize("arch", zoo_archs.ARCHS)
def test_the_compiled_step_holds_every_zoo_graph(zoo, arch):
    """Every graph the zoo builds decodes through the compiled step (CacheLists: falcon_h1's mixer +
    attention, deepseek_v32's latent + indexer; gemma3n's shared layers reading their owner's buffers;
    a rope whose base follows the position, internlm3's): the exact path's greedy ids, logits within
    float32 rounding, the state handed back. Where the cache list holds a cache the model never
    writes (nemotron-nas: a linear-replacement layer's, as mlx-lm's list) or routes through host
    values (dbrx), the step refuses by name."""
    if arch in _REFUSED:
        with pytest.raises(CompileGap, match=_REFUSED[arch]):
            _decode_both(zoo(arch), steps=8, prompt=[(i * 7) % 50 + 1 for i in range(12)])
        return
    model, exact, static, dec, pairs = _decode_both(zoo(arch), steps=8, prompt=[(i * 7) % 50 + 1 for i in range(12)])
    assert all(mx.array_equal(mx.argmax(e, -1), mx.argmax(f, -1)) for e, f in pairs)
    assert max(mx.abs(e - f).max().item() for e, f in pairs) < 1e-4
    dec.write_back()
    y = mx.array([[11]])
    assert mx.abs(model(y, cache=exact) - model(y, cache=static)).max().item() < 1e-4


class _ReadsThePosition(nn.Module):
    """A graph that reads its cache's position into Python (what a compiled step cannot trace)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def __call__(self, ids, cache=None):
        if int(cache[0].offset) < 0:  # evaluates the step's position array
            raise AssertionError
        return self.inner(ids, cache=cache)


def test_the_compiled_step_refuses_what_it_cannot_hold(zoo):
    model = open_model(zoo("llama"))
    cache = model.make_cache(max_kv_size=64)  # rings keeping 4 sink tokens
    model(mx.array([[1, 2]]), cache=cache)
    with pytest.raises(CompileGap, match="keeps sink tokens"):
        CompiledDecoder(model, cache, room=4)
    cache = model.make_cache()
    model(mx.array([[1, 2]]), cache=cache)
    dec = CompiledDecoder(_ReadsThePosition(model), cache, room=4)
    with pytest.raises(CompileGap, match="does not trace"):
        dec(mx.array([[3]]))
    with pytest.raises(CompileGap, match="keeps no cache"):
        CompiledDecoder(model, [], room=4)


@pytest.mark.parametrize("shape, rows, at", [
    ((2, 3, 16, 8), 1, 0), ((2, 3, 16, 8), 1, 15), ((1, 4, 16, 8), 5, 7),  # K/V rows, a verify step
    ((1, 4, 16), 3, 2),  # TurboQuant norms [B, H, T]
    ((1, 2, 16, 4), 2, 14),  # packed codes
])
@pytest.mark.parametrize("scatter_from", [0, 1 << 40])
def test_write_rows_writes_what_a_slice_update_writes(monkeypatch, shape, rows, at, scatter_from):
    """The static caches' write (a scatter into large buffers: in place on CUDA, where MLX's dynamic
    slice update copies the buffer) puts the same values in the same places and leaves every other
    position alone, in every dtype the caches hold, by either op."""
    monkeypatch.setattr(static_cache, "SCATTER_FROM_BYTES", scatter_from)
    for dtype in (mx.float16, mx.bfloat16, mx.float32, mx.uint32, mx.uint8):
        buf = (mx.arange(int(mx.prod(mx.array(shape)).item())).reshape(shape) % 97).astype(dtype)
        new = (mx.random.uniform(0, 90, (*shape[:2], rows, *shape[3:]), key=mx.random.key(at))).astype(dtype)
        pos = mx.array(at, dtype=mx.int32)
        want = mx.slice_update(buf, new, pos.reshape(1), axes=(2,))
        got = static_cache.write_rows(buf, new, pos)
        assert got.dtype == dtype and mx.array_equal(got, want), (shape, rows, at, dtype)
        assert mx.array_equal(mx.compile(static_cache.write_rows)(buf, new, pos), want)


@pytest.mark.parametrize("arch, steps, scatter", [("llama", 30, False), ("gemma3_text", 30, False),
                                                  ("llama", 600, False), ("llama", 30, True)])
def test_turboquant_caches_decode_in_the_compiled_step(zoo, monkeypatch, arch, steps, scatter):
    """TurboQuantKVCache layers (every full-attention layer but the last of a model with more than
    two: mlx-vlm's rule; gemma3_text's windows stay rings) decode in the compiled step from their
    packed codes, quantized by the same codecs: the exact path's logits within float32 rounding and
    its greedy ids (600 steps: past the exact cache's 512-key attention chunks), and the packed state
    handed back whole (`scatter`: the norms and codes written by scatter, as large buffers are)."""
    from mlxbun.cache.turboquant import TurboQuantKVCache
    from mlxbun.generation_caches import kv_quantizer, make_generation_cache

    if scatter:
        monkeypatch.setattr(static_cache, "SCATTER_FROM_BYTES", 0)

    model = open_model(zoo(arch))
    hook = kv_quantizer("turboquant", 3.5, 64, 0)
    prompt = mx.array([[(i * 7) % 50 + 1 for i in range(20)]])
    exact, static = (make_generation_cache(model, kv_bits=3.5, kv_scheme="turboquant") for _ in range(2))
    for cache in (exact, static):
        model(prompt, cache=cache)
        hook(cache)
    assert any(isinstance(c, TurboQuantKVCache) for c in static) and not hook.pending(static)
    dec = CompiledDecoder(model, static, room=steps)
    y, worst = mx.array([[7]]), 0.0
    for _ in range(steps):
        e, f = model(y, cache=exact)[:, -1, :], dec(y)
        worst = max(worst, mx.abs(e - f).max().item())
        assert mx.array_equal(mx.argmax(e, -1), mx.argmax(f, -1))
        y = mx.argmax(e, axis=-1)[:, None]
    assert worst < 1e-4
    dec.write_back()
    for e, f in zip(exact, static):
        assert type(f) is type(e) and f.offset == e.offset
        if isinstance(f, TurboQuantKVCache):
            assert all(mx.array_equal(a, b) for a, b in zip(e.state, f.state))  # the same codes, not close


@pytest.mark.parametrize("options, compiled", [
    ({"kv_bits": 4}, True), ({"kv_bits": 3.5, "kv_scheme": "turboquant"}, True),
    ({"kv_bits": 4, "quantized_kv_start": 100}, False),  # converts mid-decode: eager, and said
])
def test_fast_generation_compiles_once_the_kv_cache_is_converted(zoo, options, compiled):
    path = zoo("llama", head_dim=64)
    model, tok = open_model(path), load_tokenizer(path)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    exact = [r.token for r in stream_generate(model, tok, prompt, max_tokens=12, **options)]
    fast = enable_fast(model)
    got = [r.token for r in stream_generate(model, tok, prompt, max_tokens=12, fast=fast, **options)]
    assert got == exact
    off = [n for n in fast.notes if "compiled decode" in n]  # off at the start, or stopped on the way
    assert (not off) == compiled, fast.notes
    assert compiled or "KV quantization converts the caches while decoding" in off[0]


def test_a_full_static_cache_stops_the_compiled_step(zoo):
    model = open_model(zoo("llama"))
    cache = model.make_cache()
    model(mx.array([[1] * 250]), cache=cache)
    dec = CompiledDecoder(model, cache, room=4)  # capacity 256
    for _ in range(6):
        dec(mx.array([[2]]))
    with pytest.raises(CompileGap, match="full"):
        dec(mx.array([[2]]))


# ------------------------------------------------------------------ generation and the CLI


def test_fast_generation_matches_greedy_and_says_what_did_not_apply(zoo):
    for arch, note, options in (("llama", None, {}), ("falcon_h1", None, {}),
                                ("llama", "keeps sink tokens", {"max_kv_size": 64})):
        path = zoo(arch, quant=4)
        model, tok = open_model(path), load_tokenizer(path)
        exact = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=10, **options)]
        fast = enable_fast(model)
        got = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=10, fast=fast, **options)]
        assert got == exact
        assert (note is None) == (not any("compiled decode off" in n for n in fast.notes))
        assert note is None or any(note in n for n in fast.notes)


def test_fast_generation_hands_the_cache_back(zoo):
    path = zoo("llama")
    model, tok = open_model(path), load_tokenizer(path)
    cache = model.make_cache()
    out = [r.token for r in stream_generate(model, tok, [1, 2, 3], max_tokens=5, prompt_cache=cache, fast=True)]
    assert len(out) == 5 and cache[0].offset >= 3 + 4  # the prompt and the decoded tokens fed back


def test_cli_fast_flag(zoo, capsys):
    path = str(zoo("llama", quant=4))
    assert cli.main(["generate", "--model", path, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--fast",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fast"]["fidelity"] == "L2-fast" and "compiled decode step" in out["fast"]["path"]
    assert cli.main(["generate", "--model", path, "--prompt-ids", "1,2,3", "--fast", "--engine", "mlx-lm"]) != 0
    assert "no fast path" in capsys.readouterr().err  # (with --draft: tests/test_fast_speculative.py)


# ------------------------------------------------------------------ the recorded drift


def test_bench_fast_records_its_drift(zoo_root, tmp_path):
    db = tmp_path / "r.sqlite"
    res = run_bench("zoo:llama", quant=4, prompt_len=8, gen_len=6, trials=1, warmup=0, fast=True,
                    zoo_root=zoo_root, results=db, progress=False)
    assert res.fast["fidelity"] == "L2-fast" and res.fast["positions"] == 6
    assert res.checks["prefill_logits_bit_exact"] is None  # never claimed for a fast run
    assert "drift vs the exact path" in res.to_markdown()
    with open_results(db) as store:
        rows = store.load("bench", metric="fast.kld_mean")
    assert len(rows) == 1 and rows["value"].iloc[0] == res.fast["kld_mean"]
    with pytest.raises(Exception, match="gen-len"):
        run_bench("zoo:llama", quant=4, prompt_len=8, gen_len=0, fast=True, zoo_root=zoo_root, record=False)


def test_decode_fidelity_sees_a_kernel_that_drifts(zoo, monkeypatch):
    def noisy(x, w, s, b, group_size, bits, **_):  # a kernel off by a visible amount
        return _emulated_qmv(x, w, s, b, group_size, bits) * 1.05

    monkeypatch.setattr(fast_path_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(fast_linear, "weight_gap", lambda *a, **k: None)
    monkeypatch.setattr(fast_linear, "input_gap", lambda x, w, s: None)
    monkeypatch.setattr(fast_linear, "launch_qmv", noisy)
    model = open_model(zoo("llama", quant=4))
    stats = decode_fidelity(enable_fast(model), [1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert stats.count == 5 and stats.kld_mean > 0 and stats.max_abs_diff > 0
