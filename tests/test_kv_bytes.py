"""KV bytes per token (mlxbun/bench/kv_bytes.py): the closed form from a config equals the bytes
the caches hold after a prefill, per scheme and MLA layout; the MLA command on a tiny setting."""

import pytest

from mlxbun.bench.kv_bytes import SCHEMES, KVLayout, Refused, layout_bytes, measured_bytes, mla_layouts, total_bytes
from mlxbun.errors import MlxbunError
from mlxbun.zoo.archs import tiny_config

# the zoo's MLA recipes with cache widths group 64 divides (as mlxbun.bench.mla_kv.ZOO_WIDE)
WIDE_V2 = {**tiny_config("deepseek_v2"), "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64}
WIDE_V3 = {**tiny_config("deepseek_v3"), "qk_rope_head_dim": 64}

DEEPSEEK_V3 = dict(num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)


def test_deepseek_v3_closed_form_by_hand():
    lay = mla_layouts(DEEPSEEK_V3)
    assert lay["latent"] == KVLayout("latent", 1, 512, 64) and lay["latent"].values_per_token == 576
    assert lay["mha"].values_per_token == lay["expanded"].values_per_token == 128 * (192 + 128)
    assert layout_bytes(lay["latent"], "16bit") == 576 * 2
    assert layout_bytes(lay["mha"], "16bit") == 128 * 320 * 2
    # q8, group 64: 192 + 2 * 3 scales/biases * 2 bytes per key, 128 + 2 * 2 * 2 per value
    assert layout_bytes(lay["expanded"], "q8") == 128 * ((192 + 12) + (128 + 8))
    assert layout_bytes(lay["expanded"], "q4") == 128 * ((96 + 12) + (64 + 8))
    # TurboQuant 3.5: 3-bit keys, 4-bit values, a float16 norm per vector, uint32 words
    assert layout_bytes(lay["expanded"], "turboquant3.5") == 128 * ((2 + 4 * 18) + (2 + 4 * 16))
    assert layout_bytes(lay["latent"], "turboquant3.5") == (2 + 4 * 48) + (2 + 4 * 8)
    assert layout_bytes(lay["latent"], "q8-latent") == (512 + 2 * 8 * 2) + (64 + 2 * 1 * 2)
    assert isinstance(layout_bytes(lay["latent"], "q8"), Refused)  # as mlx-lm: not runnable
    assert layout_bytes(lay["mha"], "q8-latent").reason.startswith("n/a")
    # over 61 layers; TurboQuant keeps the last at 16 bits (mlx-vlm's rule)
    assert total_bytes(lay["latent"], "16bit", 61) == 61 * 1152
    assert total_bytes(lay["latent"], "turboquant3.5", 61) == 60 * 228 + 1152
    assert total_bytes(lay["latent"], "turboquant3.5", 2) == 2 * 228
    assert isinstance(total_bytes(lay["latent"], "q4", 61), Refused)


def test_minicpm3_value_dim_and_group_refusal():
    lay = mla_layouts(dict(num_attention_heads=40, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                           hidden_size=2560))
    assert lay["expanded"] == KVLayout("expanded", 40, 96, 64) and lay["mha"].heads == 40
    assert "96 is not a multiple of the group size 64" in layout_bytes(lay["expanded"], "q8").reason
    assert layout_bytes(lay["expanded"], "q8", group_size=32) == 40 * ((96 + 2 * 3 * 2) + (64 + 2 * 2 * 2))


def test_bad_config_names_the_key():
    with pytest.raises(MlxbunError, match="kv_lora_rank"):
        mla_layouts({**DEEPSEEK_V3, "kv_lora_rank": 0})
    with pytest.raises(MlxbunError, match="unknown KV scheme"):
        layout_bytes(KVLayout("mha", 1, 64, 64), "q3")


@pytest.mark.parametrize("config, layout", [(WIDE_V2, "expanded"), (WIDE_V3, "latent")])
def test_closed_form_equals_the_caches_bytes(config, layout):
    lay = mla_layouts(config)[layout]
    for scheme in SCHEMES:
        closed, got = layout_bytes(lay, scheme), measured_bytes(config, scheme, tokens=256)
        assert isinstance(got, Refused) == isinstance(closed, Refused), (scheme, closed, got)
        if isinstance(got, int):
            assert got == closed, scheme
    assert "MLA latent" in measured_bytes(WIDE_V3, "q8").reason  # generation's refusal, as mlx-lm fails


def test_a_turboquant_split_is_counted_and_measured():
    """`turboquant3.5,keys=4` (the KV grammar's split): on a latent cache, whose keys (the latent)
    are wider than its values (the rope key), the extra bit on the keys costs bytes."""
    lay = mla_layouts(DEEPSEEK_V3)["latent"]
    assert layout_bytes(lay, "turboquant3.5,keys=4") == (2 + 4 * 64) + (2 + 4 * 6)  # 512 x 4 + 64 x 3 bits
    assert layout_bytes(lay, "turboquant:keys=3,values=4") == layout_bytes(lay, "turboquant3.5")
    assert total_bytes(lay, "turboquant3.5,keys=4", 61) == 60 * 284 + 1152
    wide = mla_layouts(WIDE_V3)["latent"]
    assert measured_bytes(WIDE_V3, "turboquant3.5,keys=4", tokens=256) == layout_bytes(wide, "turboquant3.5,keys=4")
    with pytest.raises(MlxbunError, match="keys=8 leaves values"):
        layout_bytes(lay, "turboquant3.5,keys=8")


def test_measured_needs_whole_growth_steps():
    with pytest.raises(MlxbunError, match="multiple of 256"):
        measured_bytes(WIDE_V3, "16bit", tokens=100)


def test_mla_kv_command_on_a_tiny_setting(capsys, zoo_root):
    from mlxbun.bench.mla_kv import main

    assert main(["--configs", "zoo:deepseek_v2,zoo:deepseek_v3", "--prompt", "8", "--continuation", "8",
                 "--zoo-root", str(zoo_root)]) == 0
    out = capsys.readouterr().out
    assert "| zoo:deepseek_v3 | **latent** | 144 |" in out and "| zoo:deepseek_v3 | latent | 0.3 |" in out  # 2 bytes x (64 latent + 8 rope key)
    assert out.count("= closed form (256 tokens)") == 4
    assert "| zoo:deepseek_v3 widened (64 / 64) | q8-latent | 0.281 |" in out  # (64 + 2*4) / 256 bytes
    assert "zoo:deepseek_v3 (64 / 8) q8" in out and "MLA latent" in out  # refusals listed


def test_mla_kv_command_refuses_an_unknown_config():
    from mlxbun.bench.mla_kv import main

    with pytest.raises(SystemExit, match="unknown config"):
        main(["--configs", "DeepSeek-V9", "--no-quality"])
