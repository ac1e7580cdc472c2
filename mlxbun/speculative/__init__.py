"""Speculative decoding over any RuntimeModel: drafters, verification, the round loop, statistics.

    from mlxbun.speculative import speculative_generate, NGramDrafter
    for r in speculative_generate(target, tokenizer, "Hello", drafter=NGramDrafter(), num_draft=4):
        print(r.text, end="")
    print(r.stats.summary())
"""

from mlxbun.speculative.adaptive import AdaptiveDraftLength
from mlxbun.speculative.drafters import (
    Draft,
    Drafter,
    DraftModelDrafter,
    DraftSession,
    LayerSkipDrafter,
    NGramDrafter,
    VocabularyMismatchError,
    make_drafter,
)
from mlxbun.speculative.engine import (
    SpecResponse,
    speculative_generate,
    speculative_generate_step,
    speculative_text,
)
from mlxbun.speculative.replay import Rollback
from mlxbun.speculative.stats import SpecStats
from mlxbun.speculative.verify import Sampling, Verdict, verify_greedy, verify_sampled

__all__ = [
    "AdaptiveDraftLength", "Draft", "DraftModelDrafter", "DraftSession", "Drafter", "LayerSkipDrafter",
    "NGramDrafter", "Rollback", "Sampling", "SpecResponse", "SpecStats", "Verdict", "VocabularyMismatchError",
    "make_drafter", "speculative_generate", "speculative_generate_step", "speculative_text", "verify_greedy",
    "verify_sampled",
]
