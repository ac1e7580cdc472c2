"""Masked (LLaDA-style) diffusion decoding and the llada2_moe graph.

L2 references, both run in this process on the tiny checkpoint (`mlxbun.zoo.llada`):
- mlx-vlm 0.7.10 `mlx_vlm/models/llada2_moe` (installed --no-deps, as for TurboQuant): its
  strict loader loads the checkpoint, its forward equals mlxbun's graph bit for bit (plain and
  cached, both MoE geometries), and its `LanguageModel.generate` produces the same ids as
  `masked_diffusion_generate` over mlxbun's graph and over mlx-vlm's own model;
- mlx-optiq 0.7.7 `optiq/models/llada2.py` `diffusion_generate` (the per-step floor schedule
  mlx-vlm lacks): run from the wheel's single file (never `import optiq`, which patches
  mlx-lm), from $MLXBUN_OPTIQ_WHEEL when it names the wheel, else from the installed mlx-optiq.
Hand-checked cases with scripted logits pin the transfer rule, the floor, EOS stop, mask
predictions and the stats without any reference.
"""

from __future__ import annotations

import math
import os
import sys
import types
import zipfile
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_vlm.models.cache import StaticPrefixKVCache
from mlx_vlm.models.llada2_moe.config import ModelConfig as VlmConfig
from mlx_vlm.utils import load_model as vlm_load  # the L2 oracle (conftest refuses a run without it)

from mlxbun.cache.kv import KVCache
from mlxbun.diffusion.masked import (
    DiffusionArgumentError,
    masked_diffusion,
    masked_diffusion_generate,
    transfer_floors,
)
from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError
from mlxbun.models.llada2 import LLaDA2Args, load_llada2
from mlxbun.zoo.llada import MASK_ID, llada2_tiny_config, make_llada2_checkpoint

EOS = 2  # the zoo tokenizer's <|end_of_text|>


def _optiq_module():
    """optiq/models/llada2.py executed alone (it imports only mlx and mlx-lm)."""
    source = None
    wheel = os.environ.get("MLXBUN_OPTIQ_WHEEL")
    if wheel and Path(wheel).is_file():
        with zipfile.ZipFile(wheel) as z:
            source, where = z.read("optiq/models/llada2.py").decode(), f"{wheel}/optiq/models/llada2.py"
    else:  # conftest refuses a run where mlx-optiq is missing
        f = metadata.distribution("mlx-optiq").locate_file("optiq/models/llada2.py")
        source, where = Path(f).read_text(), str(f)
    name = "_optiq_llada2_reference"
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    exec(compile(source, where, "exec"), mod.__dict__)
    return mod


optiq = _optiq_module()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    return make_llada2_checkpoint(tmp_path_factory.mktemp("llada"), seed=0)


@pytest.fixture(scope="session")
def ours(ckpt):
    return load_llada2(ckpt)


@pytest.fixture(scope="session")
def ref(ckpt):
    return vlm_load(ckpt)  # strict load


class VlmRuntime:
    """mlx-vlm's model behind the loop's model interface (tests only)."""

    bidirectional = True

    def __init__(self, model):
        self.m = model

    def make_cache(self):
        return [KVCache() for _ in self.m.layers]

    def __call__(self, ids, cache=None):
        return self.m.language_model(ids, cache=cache).logits

    def forward_hidden(self, ids, cache=None):
        return self.m.language_model.model(ids, cache=cache)


def prompt_for(seed: int) -> list[int]:
    return [(seed * 31 + i * 7 + 3) % 500 + 5 for i in range(3 + seed)]


def vlm_generate(ref, prompt, *, gen, block, steps, threshold, temperature=0.0, eos=EOS, seed=0):
    if temperature:
        mx.random.seed(seed)  # mlx-vlm samples from the global generator
    out = ref.language_model.generate(
        mx.array([prompt]), temperature=temperature, block_length=block, steps=steps,
        gen_length=gen, threshold=threshold, eos_id=eos, mask_id=MASK_ID, eos_early_stop=True)
    return out[0].tolist()


def ours_generate(model, prompt, *, gen, block, steps, threshold, temperature=0.0, eos=EOS,
                  seed=0, min_transfer=1):
    return masked_diffusion(model, prompt, mask_token_id=MASK_ID, max_tokens=gen,
                            block_length=block, steps=steps, threshold=threshold,
                            min_transfer=min_transfer, temperature=temperature,
                            eos_token_ids=[eos], seed=seed if temperature else None)


# -- checkpoint and graph --------------------------------------------------------------


def test_tiny_config_is_llada2_mini_shrunk():
    """Every key is one mlx-vlm's ModelConfig knows; every knob but the sizes, the token ids
    and the torch dtype is its default (the released model's)."""
    cfg = llada2_tiny_config()
    known = set(VlmConfig.__dataclass_fields__) | {"architectures", "torch_dtype"}
    assert set(cfg) <= known, set(cfg) - known
    shrunk = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
              "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
              "max_position_embeddings", "pad_token_id", "eos_token_id", "mask_token_id",
              "architectures", "torch_dtype"}
    defaults = VlmConfig()
    for key in set(cfg) - shrunk:
        assert cfg[key] == getattr(defaults, key), key
    assert cfg["vocab_size"] == 512 and cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    assert cfg["first_k_dense_replace"] == 1  # layer 0 dense, layer 1 MoE


def test_checkpoint_has_hub_layout(ckpt, ours):
    from mlxbun.models.runtime import RuntimeModel
    from mlxbun.weights import read_index

    names = read_index(ckpt).names()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert not any("switch_mlp" in n for n in names)
    assert ours.audit.ok and not ours.audit.dropped
    assert isinstance(ours, RuntimeModel) and ours.bidirectional
    assert ours.mask_token_id == MASK_ID and set(ours.eos_token_ids) == {2, 4}  # generation_config


@pytest.mark.parametrize("L", [1, 5, 8, 9, 40])  # <=8: mlx-vlm's tokenwise MoE; 40: sorted gather
def test_forward_bit_exact(ours, ref, L):
    ids = mx.array([[(i * 37 + 5) % 512 for i in range(L)]])
    a = ref.language_model(ids).logits
    b = ours(ids)
    assert a.dtype == b.dtype == mx.float32 and mx.array_equal(a, b).item()
    assert mx.array_equal(ours.logits_from_hidden(ours.forward_hidden(ids)), b).item()


@pytest.mark.parametrize("block", [4, 16])
def test_cached_block_forward_bit_exact(ours, ref, block):
    """A block over a prefix cache, as both loops run it: mlx-vlm's StaticPrefixKVCache vs
    mlxbun's KVCache (trimmed back after a denoising forward, as the loop does)."""
    ids = mx.array([[(i * 53 + 11) % 512 for i in range(3 * block)]])
    pc = [StaticPrefixKVCache(3 * block) for _ in ref.layers]
    cache = ours.make_cache()
    for b in range(2):
        ref.language_model.model(ids[:, b * block:(b + 1) * block], cache=pc)
        ours.forward_hidden(ids[:, b * block:(b + 1) * block], cache=cache)
    a = ref.language_model(ids[:, 2 * block:], cache=[StaticPrefixKVCache.from_prefix(c) for c in pc]).logits
    junk = mx.array([[MASK_ID] * block])
    ours(junk, cache=cache)
    for c in cache:
        c.trim(block)
    assert mx.array_equal(a, ours(ids[:, 2 * block:], cache=cache)).item()


def test_loader_errors_name_the_culprit(ckpt, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    w = mx.load(str(bad / "model.safetensors"))
    del w["model.layers.1.mlp.experts.3.up_proj.weight"]
    mx.save_safetensors(str(bad / "model.safetensors"), w)
    with pytest.raises(LoadError, match=r"experts\.3\.up_proj"):
        load_llada2(bad)
    cfg = llada2_tiny_config()
    with pytest.raises(ConfigError, match="n_group"):
        LLaDA2Args.from_config({**cfg, "n_group": 3}, "x/config.json")
    with pytest.raises(ConfigError, match="'hidden_size'"):
        LLaDA2Args.from_config({**cfg, "hidden_size": "64"}, "x/config.json")
    with pytest.raises(UnsupportedModelError, match="quantization"):
        LLaDA2Args.from_config({**cfg, "quantization": {"bits": 4, "group_size": 64}})
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="llama"):
        load_llada2(bad)


# -- the loop against mlx-vlm -------------------------------------------------------------

# (seed, threshold, block_length, max_tokens, temperature); steps = block_length, the regime
# in which mlx-vlm's rule (threshold, best token as fallback) is the whole rule
VLM_CASES = [
    (0, 0.9, 8, 24, 0.0),
    (1, 0.5, 4, 16, 0.0),
    (2, 0.3, 8, 40, 0.0),
    (3, 0.95, 16, 32, 0.0),
    (6, 0.6, 32, 32, 0.0),   # prompt and generation in one block
    (7, 0.5, 8, 17, 0.0),    # max_tokens ends inside a block
    (8, 1.5, 4, 12, 0.0),    # nothing clears: one token per step
    (4, 0.7, 8, 24, 0.8),    # sampled
    (5, 0.2, 4, 20, 1.0),
]


@pytest.mark.parametrize("seed,threshold,block,gen,temperature", VLM_CASES)
def test_generate_equals_mlx_vlm(ours, ref, seed, threshold, block, gen, temperature):
    prompt = prompt_for(seed)
    kw = dict(gen=gen, block=block, steps=block, threshold=threshold, temperature=temperature,
              seed=seed)
    want = vlm_generate(ref, prompt, **kw)
    got, stats = ours_generate(ours, prompt, **kw)
    assert got == want
    via_ref, _ = ours_generate(VlmRuntime(ref), prompt, **kw)  # the loop alone, on mlx-vlm's graph
    assert via_ref == want
    assert stats.generation_tokens == len(got) == gen and stats.finish_reason == "length"
    assert stats.unrevealed == 0 and MASK_ID not in got
    if threshold > 1:
        assert all(set(r) == {1} for r in stats.revealed_per_step)


@pytest.mark.parametrize("seed,block,cut", [(0, 8, 13), (2, 4, 6), (3, 16, 20)])
def test_eos_stop_equals_mlx_vlm(ours, ref, seed, block, cut):
    """EOS = a token the run generates at index `cut`: both stop after the block holding its
    first occurrence and return up to and including it."""
    prompt, gen = prompt_for(seed), 4 * block
    kw = dict(gen=gen, block=block, steps=block, threshold=0.6)
    free = vlm_generate(ref, prompt, **kw, eos=EOS)
    assert EOS not in free
    eos = free[cut]
    want = vlm_generate(ref, prompt, **kw, eos=eos)
    got, stats = ours_generate(ours, prompt, **kw, eos=eos)
    assert got == want == free[:free.index(eos) + 1]
    assert stats.finish_reason == "stop" and len(got) < gen
    first_block = (len(prompt) + free.index(eos)) // block
    assert stats.blocks == first_block - len(prompt) // block + 1  # no block after the EOS one


def test_mlx_vlm_leaves_masks_below_the_floor(ours, ref):
    """Why the even-split floor: with fewer steps than masked positions and nothing clearing
    the threshold, mlx-vlm returns mask tokens; this loop finishes each block within steps."""
    prompt, kw = prompt_for(1), dict(gen=16, block=8, steps=3, threshold=1.5)
    assert MASK_ID in vlm_generate(ref, prompt, **kw)
    got, stats = ours_generate(ours, prompt, **kw)
    assert MASK_ID not in got and stats.unrevealed == 0
    assert all(len(r) <= 3 and sum(r) for r in stats.revealed_per_step)
    assert stats.revealed_per_step[1] == (3, 3, 2)


# -- the loop against mlx-optiq (the floor schedule) ---------------------------------------


class OptiqWindow:
    """optiq's loop calls model(x[:b1], mask=block-causal) and reads the last block's logits;
    this computes them the way both loops under test do (cached prefix blocks, then the
    block), so the comparison is of the decoding rule, not of matmul geometry."""

    def __init__(self, model, block):
        self.m, self.block = model, block

    def __call__(self, x, mask=None):
        ids = x[0].tolist()
        b0 = len(ids) - self.block
        cache = self.m.make_cache()
        for s in range(0, b0, self.block):
            self.m.forward_hidden(mx.array([ids[s:s + self.block]]), cache=cache)
        logits = self.m(mx.array([ids[b0:]]), cache=cache)
        return mx.concatenate([mx.zeros((1, b0, logits.shape[-1]), logits.dtype), logits], axis=1)


OPTIQ_CASES = [  # (seed, threshold, block_length, steps, max_tokens)
    (0, 0.9, 8, 2, 24),
    (1, 0.5, 8, 3, 24),
    (2, 0.95, 16, 4, 40),
    (3, 0.3, 4, 1, 16),
    (4, 0.99, 8, 8, 24),
    (5, 0.7, 16, 5, 33),
    (6, 0.9, 8, 20, 16),
]


@pytest.mark.parametrize("seed,threshold,block,steps,gen", OPTIQ_CASES)
def test_generate_equals_optiq_loop_both_over_the_mlxbun_graph(ours, seed, threshold, block, steps, gen):
    prompt = prompt_for(seed)
    want = optiq.diffusion_generate(OptiqWindow(ours, block), prompt, gen_length=gen,
                                    block_length=block, steps=steps, threshold=threshold,
                                    mask_id=MASK_ID, eos_id=EOS)
    got, stats = ours_generate(ours, prompt, gen=gen, block=block, steps=steps, threshold=threshold)
    assert got == want
    assert all(len(r) <= steps for r in stats.revealed_per_step)


# -- hand-checked cases (scripted logits) --------------------------------------------------

V, FMASK, FEOS = 16, 15, 9


class FakeCache:
    def __init__(self):
        self.offset = 0

    def is_trimmable(self):
        return True

    def trim(self, n):
        self.offset -= n
        return n


class Scripted:
    """A bidirectional 'model' whose logits for block step (cache offset, k-th call at that
    offset) are scripted as {position: (token, confidence)}; unscripted positions propose
    token 1 at confidence 0.1. Records what each forward saw."""

    bidirectional = True

    def __init__(self, script):
        self.script, self.calls, self.commits = script, [], []
        self._seen: dict[int, int] = {}

    def make_cache(self):
        self.cache = [FakeCache()]
        return self.cache

    def forward_hidden(self, ids, cache=None):
        self.commits.append((cache[0].offset, ids[0].tolist()))
        cache[0].offset += ids.shape[1]
        return mx.zeros((1, ids.shape[1], 4))

    def __call__(self, ids, cache=None):
        off = cache[0].offset
        k = self._seen.get(off, 0)
        self._seen[off] = k + 1
        self.calls.append((off, ids[0].tolist()))
        cache[0].offset += ids.shape[1]
        rows = []
        for i in range(ids.shape[1]):
            tok, conf = self.script.get((off, k), {}).get(i, (1, 0.1))
            p = [(1 - conf) / (V - 1)] * V
            p[tok] = conf
            rows.append([math.log(x) for x in p])
        return mx.array([rows], dtype=mx.float32)


def run(model, prompt, **kw):
    args = dict(mask_token_id=FMASK, max_tokens=7, block_length=4, steps=3, threshold=0.5,
                eos_token_ids=[FEOS])
    args.update(kw)
    return list(masked_diffusion_generate(model, prompt, **args))


def test_hand_checked_threshold_and_floor():
    # prompt [5] + 7 tokens = 8 positions = 2 blocks of 4; steps 3
    # block 0 (offset 0): masked positions 1,2,3 -> floors [1,1,1]
    #   step 1: conf 0.9 / 0.4 / 0.6 -> 1 and 3 clear 0.5;  step 2: position 2 by the floor
    # block 1 (offset 4): 4 masked -> floors [2,1,1]
    #   step 1: 0.2 / 0.45 / 0.1 / 0.3, none clears -> the two best: 1 (0.45) and 3 (0.3)
    #   step 2: position 2 at 0.9 clears;  step 3: position 0 by the floor
    script = {
        (0, 0): {1: (6, 0.9), 2: (7, 0.4), 3: (8, 0.6)},
        (0, 1): {2: (3, 0.3)},
        (4, 0): {0: (10, 0.2), 1: (11, 0.45), 2: (12, 0.1), 3: (13, 0.3)},
        (4, 1): {0: (10, 0.2), 2: (12, 0.9)},
        (4, 2): {0: (4, 0.15)},
    }
    m = Scripted(script)
    out = run(m, [5])
    assert [r.block for r in out] == [0, 1]
    assert out[0].tokens == (6, 3, 8) and out[0].revealed_per_step == (2, 1) and out[0].stats is None
    last = out[1]
    assert last.tokens == (6, 3, 8, 4, 11, 12, 13) and last.block_tokens == (4, 11, 12, 13)
    assert last.revealed_per_step == (2, 1, 1) and last.finish_reason == "length"
    s = last.stats
    assert s.nfe == 5 and s.cache_forwards == 1 and s.blocks == 2
    assert s.revealed_per_step == ((2, 1), (2, 1, 1))
    assert s.reveal_step == (1, 2, 1, 3, 1, 2, 1)
    assert s.reveal_nfe == (1, 2, 1, 5, 3, 4, 3)
    assert s.tokens_per_forward == 7 / 5 and s.forwards == 6
    # each denoising forward saw only its block, over the committed prefix
    assert [c[0] for c in m.calls] == [0, 0, 4, 4, 4]
    assert m.calls[0][1] == [5, FMASK, FMASK, FMASK]
    assert m.calls[3][1] == [FMASK, 11, FMASK, 13]
    assert m.commits == [(0, [5, 6, 3, 8])]  # block 0 committed once; the last block never


def test_hand_checked_min_transfer_and_even_split():
    assert transfer_floors(4, 3) == [2, 1, 1]
    assert transfer_floors(3, 5) == [1, 1, 1, 1, 1]  # never below min_transfer (1)
    assert transfer_floors(7, 2, min_transfer=5) == [5, 5]
    # min_transfer 3, nothing clears: 3 most confident of block 0's positions 1..3, then block 1
    script = {(0, 0): {1: (6, 0.2), 2: (7, 0.3), 3: (8, 0.25)},
              (4, 0): {0: (10, 0.11), 1: (11, 0.4), 2: (12, 0.3), 3: (13, 0.2)},
              (4, 1): {0: (14, 0.2)}}
    out = run(Scripted(script), [5], min_transfer=3, threshold=0.95)
    assert out[-1].stats.revealed_per_step == ((3,), (3, 1))
    assert out[-1].tokens == (6, 7, 8, 14, 11, 12, 13)


def test_hand_checked_eos_stop_and_mask_predictions():
    # block 0: position 2 proposes the mask token at 0.99 -> stays masked; position 1 EOS;
    # position 3 a token. Next step position 2 gets a token; EOS at generated index 0 stops
    # the run after block 0, though max_tokens spans two blocks
    script = {(0, 0): {1: (FEOS, 0.8), 2: (FMASK, 0.99), 3: (8, 0.7)},
              (0, 1): {2: (7, 0.3)}}
    m = Scripted(script)
    out = run(m, [5])
    assert len(out) == 1 and out[0].finish_reason == "stop" and out[0].tokens == (FEOS,)
    s = out[0].stats
    assert s.revealed_per_step == ((2, 1),) and s.nfe == 2 and s.cache_forwards == 0
    assert m.commits == []
    # a position that only ever proposes the mask stays masked and is reported
    stuck = {(0, k): {2: (FMASK, 0.99), 1: (6, 0.9), 3: (8, 0.9)} for k in range(3)}
    out = run(Scripted(stuck), [5], max_tokens=3)
    s = out[-1].stats
    assert out[-1].tokens == (6, FMASK, 8) and s.unrevealed == 1 and s.reveal_step == (1, 0, 1)
    assert s.revealed_per_step == ((2, 0, 0),) and s.nfe == 3


def test_prompt_blocks_are_prefilled():
    # prompt of 6 with block 4: block 0 is all prompt (prefilled), block 1 holds 2 prompt tokens
    m = Scripted({(4, 0): {2: (6, 0.9), 3: (7, 0.9)}, (8, 0): {0: (8, 0.9)}})
    out = run(m, [1, 2, 3, 4, 5, 6], max_tokens=3)
    assert m.commits[0] == (0, [1, 2, 3, 4]) and m.calls[0] == (4, [5, 6, FMASK, FMASK])
    assert out[-1].tokens == (6, 7, 8) and out[-1].stats.cache_forwards == 2


@pytest.mark.parametrize("kw,name", [
    (dict(block_length=0), "block_length"), (dict(steps=-1), "steps"),
    (dict(min_transfer=0), "min_transfer"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(threshold=float("nan")), "threshold"),
    (dict(seed=-3), "seed"), (dict(eos_token_ids=["x"]), "eos_token_ids"),
])
def test_bad_arguments_are_named(kw, name):
    with pytest.raises(DiffusionArgumentError, match=name):
        run(Scripted({}), [5], **kw)
    with pytest.raises(DiffusionArgumentError, match="prompt_ids"):
        run(Scripted({}), [])


def test_ids_outside_the_vocabulary_are_named(ours):
    with pytest.raises(DiffusionArgumentError, match="mask_token_id = 512"):
        masked_diffusion(ours, [5, 6], mask_token_id=512, max_tokens=4, block_length=4)
    with pytest.raises(DiffusionArgumentError, match="token 600"):
        masked_diffusion(ours, [5, 600], mask_token_id=MASK_ID, max_tokens=4, block_length=4)


def test_causal_model_is_refused():
    class Causal(Scripted):
        bidirectional = False

    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        run(Causal({}), [5])
