"""Speculative decoding over any RuntimeModel: drafters, verification, the round loop, statistics.

    from mlxbun.spec import speculative_generate, NGramDrafter
    for r in speculative_generate(target, tokenizer, "Hello", drafter=NGramDrafter(), num_draft=4):
        print(r.text, end="")
    print(r.stats.summary())
"""

from mlxbun.spec.adaptive import AdaptiveDraftLength
from mlxbun.spec.drafters import (
    Draft,
    DraftModelDrafter,
    DraftSession,
    Drafter,
    LayerSkipDrafter,
    NGramDrafter,
    VocabularyMismatchError,
)
from mlxbun.spec.engine import (
    SpecResponse,
    make_drafter,
    speculative_generate,
    speculative_generate_step,
    speculative_text,
)
from mlxbun.spec.stats import SpecStats
from mlxbun.spec.verify import Sampling, Verdict, verify_greedy, verify_sampled

__all__ = [
    "AdaptiveDraftLength", "Draft", "DraftModelDrafter", "DraftSession", "Drafter", "LayerSkipDrafter",
    "NGramDrafter", "Sampling", "SpecResponse", "SpecStats", "Verdict", "VocabularyMismatchError",
    "make_drafter", "speculative_generate", "speculative_generate_step", "speculative_text", "verify_greedy",
    "verify_sampled",
]
