"""Block-diffusion engine (`mlxbun.diffusion`) held token-for-token to mlx-vlm 0.7.10's
`stream_diffusion_generate` (L2), on the tiny DiffusionGemma zoo checkpoint.

The oracle runs mlx-vlm's model and processor as `mlx_vlm.load` returns them; ids, finish
reason and mlx-vlm's own counters (denoising steps, canvas tokens, generation tokens) must
match for both samplers, three seeds, several canvas sizes and lengths spanning several
blocks, and for every option that changes the draws (temperature, stability stop, EOS,
show-unmasking, compile, chunked prefill, seeded canvases, schedule and bound overrides).
The engine also drives mlx-vlm's model directly, which isolates the loop from the graph.
"""

import mlx.core as mx
import pytest

from mlxbun.diffusion import (
    DiffusionStats,
    collect,
    diffusion_generate,
    linear_temperature,
    resolve_settings,
    reveal_steps,
)
from mlxbun.diffusion.schedule import block_canvas_length
from mlxbun.errors import MlxbunError
from mlxbun.models.diffusion_gemma.loader import load_diffusion_gemma
from mlxbun.zoo.diffusion import cached_diffusion_checkpoint

PROMPT = [1, 40, 77, 300, 12, 9, 100, 200, 350, 18, 7, 41]
LONG_PROMPT = PROMPT + list(range(60, 82))  # past the window; 68 (token, expert) pairs


@pytest.fixture(scope="session")
def ckpt(zoo_root):
    return cached_diffusion_checkpoint(root=zoo_root)


@pytest.fixture(scope="session")
def ours(ckpt):
    return load_diffusion_gemma(ckpt)


@pytest.fixture(scope="session")
def tok(ckpt):
    from mlxbun.tokenizer import load_tokenizer

    return load_tokenizer(ckpt)


@pytest.fixture(scope="session")
def vlm(ckpt):
    import mlx_vlm

    return mlx_vlm.load(str(ckpt), strict=True)


@pytest.fixture(scope="session")
def oracle(vlm):
    """oracle(prompt, seed, generation_config=None, extra_eos=(), **mlx-vlm kwargs) ->
    (ids, last GenerationResult). Collects ids as mlx-vlm's Model.generate does."""
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    model, processor = vlm

    def run(prompt, seed, *, generation_config=None, extra_eos=(), **kw):
        criteria = processor.tokenizer.stopping_criteria
        saved_gc, saved_eos = model.config.generation_config, list(criteria.eos_token_ids)
        if generation_config is not None:
            model.config.generation_config = generation_config
        criteria.eos_token_ids.extend(extra_eos)
        try:
            mx.random.seed(seed)
            ids, last = [], None
            for r in stream_diffusion_generate(model, processor, processor.tokenizer, mx.array([prompt]),
                                               None, None, skip_special_token_ids=[], **kw):
                last = r
                if (r.token is not None and not r.is_draft and not r.diffusion_block_complete
                        and r.finish_reason is None):
                    ids.append(int(r.token))
            return ids, last
        finally:
            model.config.generation_config = saved_gc
            criteria.eos_token_ids[:] = saved_eos

    return run


@pytest.fixture(scope="session")
def gen_config(vlm):
    return dict(vlm[0].config.generation_config)


def _check_stats(stats: DiffusionStats, ids):
    assert stats.tokens == ids
    assert stats.generation_tokens == len(ids) + (stats.stop_token is not None)
    assert sum(b.emitted for b in stats.blocks) == stats.generation_tokens
    assert stats.nfe == sum(b.steps for b in stats.blocks)
    assert stats.canvas_tokens == sum(b.canvas_length for b in stats.blocks)
    assert stats.work_tokens == sum(b.canvas_length * b.steps for b in stats.blocks)
    assert stats.encoder_passes == len(stats.blocks)
    assert stats.tokens_per_forward == pytest.approx(stats.generation_tokens / stats.nfe)
    for b in stats.blocks:
        assert len(b.reveal_step) == b.canvas_length
        assert all(1 <= s <= b.steps for s in b.reveal_step)
        assert sum(b.revealed_per_step) == b.canvas_length
        assert len(b.accepted_per_step) in (b.steps - 1, b.steps)
        assert b.emitted <= b.canvas_length


def _compare(ours, tok, oracle, ours_kw, vlm_kw, *, prompt=PROMPT, seed=0, **oracle_kw):
    ids, stats = collect(diffusion_generate(ours, tok, prompt, seed=seed, **ours_kw))
    want, last = oracle(prompt, seed, **vlm_kw, **oracle_kw)
    assert ids == want
    assert stats.finish_reason == last.finish_reason
    assert stats.generation_tokens == last.generation_tokens
    assert stats.nfe == last.diffusion_denoising_steps
    assert stats.canvas_tokens == last.diffusion_canvas_tokens
    assert stats.work_tokens == last.diffusion_work_tokens
    if stats.finish_reason == "stop":
        assert stats.stop_token == last.token
    _check_stats(stats, ids)
    return ids, stats


SIZES = [  # (max_tokens, our canvas kwargs, mlx-vlm kwargs, expected canvas lengths)
    (40, {}, {}, [16, 16, 16]),  # default min canvas 64 > 16: always the full canvas
    (40, {"min_canvas_length": 4}, {"diffusion_min_canvas_length": 4}, [16, 16, 8]),
    (20, {"max_canvas_length": 6, "min_canvas_length": 4},
     {"diffusion_max_canvas_length": 6, "diffusion_min_canvas_length": 4}, [6, 6, 6, 4]),
]


@pytest.mark.parametrize("sampler", ["confidence-threshold", "entropy-bound"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("size", range(len(SIZES)), ids=["canvas16", "shrinking", "canvas6"])
def test_generation_equals_mlx_vlm(ours, tok, oracle, sampler, seed, size):
    max_tokens, canvas_kw, vlm_canvas_kw, lengths = SIZES[size]
    _, stats = _compare(
        ours, tok, oracle,
        dict(max_tokens=max_tokens, sampler=sampler, steps=8, **canvas_kw),
        dict(max_tokens=max_tokens, diffusion_sampler=sampler, max_denoising_steps=8, **vlm_canvas_kw),
        seed=seed,
    )
    assert [b.canvas_length for b in stats.blocks] == lengths[: len(stats.blocks)]
    if stats.finish_reason == "length":
        assert len(stats.blocks) == len(lengths) and stats.generation_tokens == max_tokens
    else:  # the random model emitted an EOS id (2 or 4) on its own
        assert stats.stop_token in (2, 4) and stats.generation_tokens <= max_tokens


def test_engine_drives_mlx_vlm_model_too(vlm, tok, oracle):
    for sampler in ("confidence-threshold", "entropy-bound"):
        ids, _ = collect(diffusion_generate(vlm[0], tok, PROMPT, max_tokens=24, seed=3, steps=6, sampler=sampler))
        want, _ = oracle(PROMPT, 3, max_tokens=24, max_denoising_steps=6, diffusion_sampler=sampler)
        assert ids == want


@pytest.mark.parametrize("sampler", ["confidence-threshold", "entropy-bound"])
def test_temperature_sampling_equals_mlx_vlm(ours, tok, oracle, sampler):
    _compare(ours, tok, oracle,
             dict(max_tokens=30, temperature=0.7, steps=10, sampler=sampler),
             dict(max_tokens=30, temperature=0.7, max_denoising_steps=10, diffusion_sampler=sampler), seed=4)


def test_stability_stop_equals_mlx_vlm(ours, tok, oracle, gen_config):
    """Entropy bound wide open: the canvas settles, and the stop fires (as in mlx-vlm)."""
    for threshold, conf in ((1, 10.0), (2, 10.0), (1, 0.05)):
        gc = dict(gen_config, stability_threshold=threshold, confidence_threshold=conf,
                  sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 100.0})
        _, stats = _compare(
            ours, tok, oracle,
            dict(max_tokens=40, steps=16, sampler="entropy-bound", entropy_bound=100.0,
                 stability_threshold=threshold, stability_confidence=conf),
            dict(max_tokens=40, max_denoising_steps=16, diffusion_sampler="entropy-bound"),
            seed=3, generation_config=gc)
        assert "stable" in [b.stopped_early for b in stats.blocks]
        assert any(b.steps < 16 for b in stats.blocks)


def test_eos_stops_mid_block(ours, tok, oracle):
    base, _ = collect(diffusion_generate(ours, tok, PROMPT, max_tokens=40, seed=4, steps=10))
    eos = base[20]
    cut = base.index(eos)
    ids, stats = _compare(ours, tok, oracle, dict(max_tokens=40, steps=10, eos_token_ids=[eos]),
                          dict(max_tokens=40, max_denoising_steps=10), seed=4, extra_eos=[eos])
    assert ids == base[:cut] and stats.finish_reason == "stop" and stats.stop_token == eos
    assert stats.generation_tokens == cut + 1
    assert 0 < stats.blocks[-1].emitted < stats.blocks[-1].canvas_length or cut % 16 == 0


@pytest.mark.parametrize("name, ours_kw, vlm_kw, oracle_kw", [
    ("show-unmasking-eb", dict(steps=6, sampler="entropy-bound", show_unmasking=True),
     dict(max_denoising_steps=6, diffusion_sampler="entropy-bound", diffusion_show_unmasking=True), {}),
    ("show-unmasking-ct", dict(steps=3, show_unmasking=True),
     dict(max_denoising_steps=3, diffusion_show_unmasking=True), {}),
    ("compile", dict(steps=6, compile=True), dict(max_denoising_steps=6, diffusion_compile=True), {}),
    ("full-canvas", dict(steps=6, full_canvas=True, min_canvas_length=2),
     dict(max_denoising_steps=6, diffusion_full_canvas=True, diffusion_min_canvas_length=2), {}),
    ("decoder-ids", dict(steps=6, decoder_input_ids=list(range(10, 30))),
     dict(max_denoising_steps=6, decoder_input_ids=mx.array([list(range(10, 30))])), {}),
    ("one-token-canvas", dict(steps=4, min_canvas_length=1, max_canvas_length=1),
     dict(max_denoising_steps=4, diffusion_min_canvas_length=1, diffusion_max_canvas_length=1), {}),
])
def test_options_equal_mlx_vlm(ours, tok, oracle, name, ours_kw, vlm_kw, oracle_kw):
    max_tokens = 8 if name == "one-token-canvas" else 30  # 8: the rotating ring wraps
    _compare(ours, tok, oracle, dict(max_tokens=max_tokens, **ours_kw), dict(max_tokens=max_tokens, **vlm_kw),
             seed=5, **oracle_kw)


def test_long_prompt_chunked_prefill_equals_mlx_vlm(ours, tok, oracle):
    _compare(ours, tok, oracle, dict(max_tokens=40, steps=6, prefill_step_size=10, max_canvas_length=8),
             dict(max_tokens=40, max_denoising_steps=6, prefill_step_size=10, diffusion_max_canvas_length=8),
             prompt=LONG_PROMPT, seed=7)


def test_generation_config_overrides_equal_mlx_vlm(ours, tok, oracle, gen_config):
    """t_min / t_max and entropy_bound given as arguments = the same values in mlx-vlm's
    generation_config; a threshold below the default."""
    _compare(ours, tok, oracle, dict(max_tokens=30, steps=6, t_min=0.2, t_max=1.5, threshold=0.5),
             dict(max_tokens=30, max_denoising_steps=6, diffusion_threshold=0.5),
             seed=9, generation_config=dict(gen_config, t_min=0.2, t_max=1.5))
    _compare(ours, tok, oracle, dict(max_tokens=30, steps=6, entropy_bound=1.5, sampler="entropy-bound"),
             dict(max_tokens=30, max_denoising_steps=6, diffusion_sampler="entropy-bound"), seed=10,
             generation_config=dict(gen_config, sampler_config={"_cls_name": "EntropyBoundSamplerConfig",
                                                                "entropy_bound": 1.5}))


def test_defaults_come_from_generation_config(ours, tok, oracle):
    """No step count given: the checkpoint's max_denoising_steps (48) and its stability stop."""
    s = resolve_settings(ours.config.generation_config, ours.config.canvas_length)
    assert (s.steps, s.entropy_bound, s.t_min, s.t_max) == (48, 0.1, 0.4, 0.8)
    assert (s.stability_threshold, s.stability_confidence) == (1, 0.005)
    _compare(ours, tok, oracle, dict(max_tokens=16, sampler="entropy-bound"),
             dict(max_tokens=16, diffusion_sampler="entropy-bound"), seed=1)


# ----------------------------------------------------------------------------- streaming + stats


def test_streams_block_by_block(ours, tok):
    gen = diffusion_generate(ours, tok, "Hello there", max_tokens=40, seed=0, steps=6, min_canvas_length=4)
    first = next(gen)
    assert first.index == 1 and len(first.tokens) == 16 and first.finish_reason is None and first.run is None
    rest = list(gen)
    assert [b.index for b in rest] == [2, 3] and rest[-1].finish_reason == "length"
    stats = rest[-1].run
    ids = first.tokens + [t for b in rest for t in b.tokens]
    assert stats.tokens == ids and len(ids) == 40
    assert first.text + "".join(b.text for b in rest) == tok.decode(ids)
    _check_stats(stats, ids)
    assert stats.summary()["blocks"] == 3


def test_confidence_reveals_match_acceptances(ours, tok):
    """confidence-threshold reveals are cumulative: each sampling step reveals exactly what it
    accepted, and a block that stops on all-revealed leaves nothing to the final argmax."""
    _, stats = collect(diffusion_generate(ours, tok, PROMPT, max_tokens=48, seed=1, steps=12))
    for b in stats.blocks:
        if b.stopped_early == "all-revealed":
            assert b.revealed_per_step == b.accepted_per_step
        else:
            assert b.revealed_per_step[:-1] == b.accepted_per_step
    assert max(max(b.accepted_per_step) for b in stats.blocks) > 1  # several tokens per step occur


def test_on_step_sees_every_sampling_step(ours, tok):
    events = []
    _, stats = collect(diffusion_generate(ours, tok, PROMPT, max_tokens=16, seed=2, steps=8, on_step=events.append))
    block = stats.blocks[0]
    assert [e.step for e in events] == list(range(1, len(block.accepted_per_step) + 1))
    assert [e.accepted for e in events] == block.accepted_per_step
    assert sum(events[-1].revealed) == sum(block.accepted_per_step)


def test_schedule_divides_the_logits(ours, tok):
    """The self-conditioning input is the decoder logits DIVIDED by the schedule temperature
    (a reciprocal multiply differs in the last bit and does not always flip an id)."""

    class Spy:
        def __init__(self, model):
            self.model, self.raw, self.processed = model, [], []

        def __getattr__(self, name):
            return getattr(self.model, name)

        def diffusion_decoder_logits(self, *a, **kw):
            self.raw.append(self.model.diffusion_decoder_logits(*a, **kw))
            return self.raw[-1]

        def diffusion_self_conditioning(self, logits, ctx):
            self.processed.append(logits)
            return self.model.diffusion_self_conditioning(logits, ctx)

    spy = Spy(ours)
    steps = 6
    _, stats = collect(diffusion_generate(spy, tok, PROMPT, max_tokens=16, seed=0, steps=steps,
                                          sampler="entropy-bound", t_min=0.3, t_max=0.7))
    assert len(spy.processed) == stats.blocks[0].steps - 1 > 2
    reciprocal_differs = []
    for i, processed in enumerate(spy.processed):
        t = linear_temperature(steps - i, steps, 0.3, 0.7)
        assert mx.array_equal(processed, spy.raw[i] / t).item()
        reciprocal_differs.append(not mx.array_equal(processed, spy.raw[i] * (1.0 / t)).item())
    assert any(reciprocal_differs)  # (equal only where t is a power of two)


def test_reveal_steps():
    # pos0 kept from step 1 on; pos1 kept at 1, dropped at 2, kept from 3; pos2 never kept
    masks = [[True, True, False], [True, False, False], [True, True, False]]
    assert reveal_steps(masks, 4, 3) == [1, 3, 4]
    assert reveal_steps([], 1, 2) == [1, 1]


def test_schedule_and_canvas_sizes():
    assert linear_temperature(8, 8, 0.4, 0.8) == 0.8
    assert linear_temperature(1, 8, 0.4, 0.8) == 0.4 + 0.4 * (1 / 8)
    assert block_canvas_length(40, 16, full_canvas=False, min_canvas_length=16, max_canvas_length=16) == 16
    assert block_canvas_length(3, 16, full_canvas=False, min_canvas_length=4, max_canvas_length=16) == 4
    assert block_canvas_length(3, 16, full_canvas=True, min_canvas_length=4, max_canvas_length=8) == 16
    s = resolve_settings({"max_denoising_steps": 12, "t_min": 0.1, "stability_threshold": 2}, 16)
    assert (s.steps, s.t_min, s.t_max, s.stability_threshold, s.stability_confidence) == (12, 0.1, 0.8, 2, 0.005)
    assert (s.min_canvas_length, s.max_canvas_length, s.max_new_tokens) == (16, 16, 256)
    assert resolve_settings({}, 16).stability_threshold is None
    assert resolve_settings({"stability_threshold": 1}, 16, stability_stop=False).stability_threshold is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(sampler="top-k"), "sampler"),
    (dict(threshold=1.5), "threshold"),
    (dict(steps=0), "steps"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_canvas_length=-1), "max_canvas_length"),
    (dict(prefill_step_size=0), "prefill_step_size"),
    (dict(temperature=-1.0), "temperature"),
    (dict(t_min=-1.0, t_max=-0.5), "temperature schedule"),
    (dict(decoder_input_ids=[[1, 2], [3, 4]]), "decoder_input_ids"),
])
def test_bad_arguments_raise(ours, kwargs, match):
    with pytest.raises(MlxbunError, match=match):
        diffusion_generate(ours, None, PROMPT, **kwargs)


def test_unsupported_sampler_config_refused(ours):
    with pytest.raises(MlxbunError, match="sampler_config"):
        resolve_settings({"sampler_config": {"_cls_name": "TopKSamplerConfig"}}, 16)
    with pytest.raises(MlxbunError, match="prompt"):
        diffusion_generate(ours, None, "text needs a tokenizer")
