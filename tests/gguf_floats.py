"""Float arrays compared as the GGUF tests need (tests/test_gguf_import.py, tests/test_gguf_kquants.py)."""

import numpy as np


def same_floats(ours, ref: np.ndarray) -> None:
    """Bit for bit, but for the sign of zero: Q4_0 code 8 (Q5_0 code 16) with a negative scale is d * (8 - 8) = -0
    in llama.cpp and d * 8 + (-8 d) = +0 in MLX's affine form (equal numbers)."""
    ours = np.array(ours)
    assert ours.dtype == ref.dtype == np.float32 and ours.shape == ref.shape
    nonzero = ref != 0
    assert np.array_equal(ours.view(np.uint32)[nonzero], ref.view(np.uint32)[nonzero])
    assert not ours[~nonzero].any()
