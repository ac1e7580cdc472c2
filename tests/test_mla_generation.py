"""Generation and speculative decoding over the MLA rows (zoo deepseek_v2 / deepseek_v3 / minicpm3 /
glm4_moe_lite / youtu_llm / mistral4 / deepseek_v32 / glm_moe_dsa): the token stream equals mlx-lm's, and speculative greedy output equals plain
decoding for every drafter kind (the absorbed kind's latent cache trims like any KV cache)."""

import mlx.core as mx
import pytest

from mlxbun.generate import stream_generate
from mlxbun.models.universal.loader import load_universal
from mlxbun.speculative import DraftModelDrafter, LayerSkipDrafter, NGramDrafter, speculative_generate
from tests.hybrid_models import IdTokenizer

PROMPT = [(7 * i * i + 3 * i) % 256 for i in range(12)] * 2
TOK = IdTokenizer()
MLA_ARCHS = ["deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "youtu_llm", "mistral4", "deepseek_v32",
             "glm_moe_dsa"]


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_generation_equals_mlx_lm(zoo, arch):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from mlxbun.generate import generate_step as our_step

    path = zoo(arch)
    prompt = mx.array([7, 3, 99, 12, 5])
    ref = [int(t) for t, _ in generate_step(prompt, load_model(path)[0], max_tokens=10)]
    model = load_universal(path)
    ours = [int(t) for t, _ in our_step(prompt, model, prompt_cache=model.make_cache(), max_tokens=10)]
    assert ours == ref and len(ours) == 10


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_speculative_greedy_equals_plain_for_every_drafter(zoo, arch):
    target, draft = load_universal(zoo(arch)), load_universal(zoo(arch, seed=1))
    plain = [r.token for r in stream_generate(target, TOK, PROMPT, max_tokens=12)]
    drafters = {"ngram": NGramDrafter, "self:1": lambda: LayerSkipDrafter(1),
                "model@seed1": lambda: DraftModelDrafter(draft)}
    for name, make in drafters.items():
        for k in (1, 2, 4):
            spec = [r.token for r in speculative_generate(target, TOK, PROMPT, drafter=make(), num_draft=k,
                                                           max_tokens=12)]
            assert spec == plain, f"{arch} {name} k={k}"
