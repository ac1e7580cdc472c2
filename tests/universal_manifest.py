"""The universal parity manifest: one entry per covered architecture.

"Supported generic" means the entry is green: its zoo checkpoint in every listed
variant passes the gate (coverage, clean weight audit, greedy trajectory equal,
every step's raw logits bit-exact vs mlx-lm 0.32.2, batch-2 forward bit-exact).
Adding a descriptor without an entry here is the one thing the design forbids
(test_manifest_covers_every_descriptor enforces it).
"""

from dataclasses import dataclass

ALL_VARIANTS = ("float32", "float16", "bfloat16", "q4", "q8", "mixed")
# MoE rows: mlx's CPU gather_mm (unquantized experts) takes float32 only, so mlx-lm cannot run
# float16 / bfloat16 experts here at all; quantized experts (gather_qmm) run in every dtype.
# tests/test_universal_dense.py holds this to `mlxbun.zoo.archs.runnable_variants`.
EXPERT_VARIANTS = ("float32", "q4", "q8", "mixed")
# afm7: mlx-lm cannot quantize its FusedLinear (zoo Arch.unquantizable)
FLOAT_VARIANTS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Entry:
    arch: str  # zoo arch == config model_type as written (before mlx-lm remapping)
    variants: tuple[str, ...] = ALL_VARIANTS
    expect_graph: str = "universal-dense"  # the graph open_model resolves (profile.execution.graph)


MANIFEST = {
    e.arch: e
    for e in [
        # the seed's eleven (+ mistral, remapped to llama by mlx-lm)
        Entry("llama"),
        Entry("mistral"),
        Entry("smollm3"),
        Entry("qwen2"),
        Entry("qwen3"),
        Entry("gemma"),
        Entry("gemma2"),
        Entry("phi3"),
        Entry("olmo2"),
        Entry("glm4"),
        Entry("glm"),
        Entry("granite"),
        Entry("starcoder2"),
        # the rest of mlx-lm 0.32.2's dense llama-family files
        Entry("gemma3_text"),
        Entry("gemma3"),  # gemma3_text behind the VLM wrapper (language_model.*, text_config)
        Entry("gemma4_text"),  # its own forward (models/universal/gemma4.py): KV sharing, per-layer inputs
        Entry("gemma4", EXPERT_VARIANTS),  # gemma4_text behind the VLM wrapper, its MoE block on
        Entry("mistral3"),  # llama's text model behind the VLM wrapper
        Entry("mistral3-mistral4", EXPERT_VARIANTS),  # mistral3 with a mistral4 text_config: mistral4's row
        Entry("mistral3-ministral3"),  # mistral3 with a ministral3 text_config: ministral3's row
        Entry("pixtral"),  # llama's text model behind the VLM wrapper, always untied
        Entry("qwen2_vl"),  # qwen2's text model behind the VLM wrapper (mrope: plain RoPE on text)
        Entry("qwen3_vl"),  # qwen3's text model behind the VLM wrapper
        Entry("olmo3"),
        Entry("cohere"),
        Entry("cohere2"),
        Entry("ernie4_5"),
        Entry("exaone4"),
        Entry("exaone"),
        Entry("helium"),
        Entry("internlm3"),
        Entry("internlm2"),
        Entry("mimo"),
        Entry("telechat3"),
        Entry("nanbeige"),
        Entry("plamo"),
        Entry("openelm"),
        Entry("plamo3"),
        Entry("spark2_5"),
        Entry("iquestloopcoder"),
        Entry("nemotron-nas"),
        Entry("talkie"),
        Entry("dbrx"),
        Entry("baichuan_m1"),
        Entry("plamo2"),
        Entry("recurrent_gemma"),
        Entry("rwkv7"),
        Entry("llama4_text"),
        Entry("muse_glimmer"),
        Entry("afm7", FLOAT_VARIANTS),
        Entry("gear"),
        Entry("seed_oss"),
        Entry("minicpm"),
        Entry("nemotron"),
        Entry("stablelm"),
        Entry("lille-130m"),
        Entry("gpt_neox"),
        Entry("gpt2"),
        Entry("gpt_bigcode"),
        Entry("gptj"),
        Entry("qwen"),
        Entry("phi"),
        Entry("hunyuan_v1_dense"),
        Entry("apertus"),
        Entry("ministral3"),
        Entry("nanochat"),
        # mixture of experts (models/universal/moe.py)
        Entry("qwen3_moe", EXPERT_VARIANTS),
        Entry("qwen3_vl_moe", EXPERT_VARIANTS),  # qwen3_moe behind the VLM wrapper
        Entry("qwen2_moe", EXPERT_VARIANTS),
        Entry("mixtral", EXPERT_VARIANTS),
        Entry("phixtral", EXPERT_VARIANTS),
        Entry("olmoe", EXPERT_VARIANTS),
        Entry("granitemoe", EXPERT_VARIANTS),
        Entry("glm4_moe", EXPERT_VARIANTS),
        Entry("solar_open", EXPERT_VARIANTS),
        Entry("exaone_moe", EXPERT_VARIANTS),
        Entry("bailing_moe", EXPERT_VARIANTS),
        Entry("hunyuan", EXPERT_VARIANTS),
        Entry("dots1", EXPERT_VARIANTS),
        Entry("deepseek", EXPERT_VARIANTS),
        Entry("deepseek_v2", EXPERT_VARIANTS),  # multi-head latent attention (universal/mla.py)
        Entry("deepseek_v3", EXPERT_VARIANTS),  # absorbed MLA (the latent cached)
        Entry("minicpm3"),  # expanded MLA, SuScaledRoPE, minicpm's muP
        Entry("glm4_moe_lite", EXPERT_VARIANTS),  # deepseek_v3's absorbed MLA, glm4_moe's router
        Entry("youtu_llm"),  # expanded MLA, initialize_rope, dense
        Entry("mistral4", EXPERT_VARIANTS),  # absorbed MLA decode, expanded prefill, llama-4 scale
        Entry("deepseek_v32", EXPERT_VARIANTS),  # absorbed MLA with the DSA indexer (CacheList)
        Entry("glm_moe_dsa", EXPERT_VARIANTS),  # deepseek_v32's graph under its own ModelArgs
        Entry("kimi_vl", EXPERT_VARIANTS),  # deepseek_v3 behind the VLM wrapper
        Entry("kimi_k25", EXPERT_VARIANTS),  # deepseek_v3 behind the VLM wrapper, its sanitize too
        Entry("gpt_oss", EXPERT_VARIANTS + ("mxfp4",)),  # mxfp4: experts as gpt-oss ships them
        Entry("phimoe", EXPERT_VARIANTS),
        Entry("ernie4_5_moe", EXPERT_VARIANTS),
        Entry("minimax_m2", EXPERT_VARIANTS),  # mlx-lm remaps it to minimax
        Entry("Klear", EXPERT_VARIANTS),
        Entry("afmoe", EXPERT_VARIANTS),
        Entry("mellum", EXPERT_VARIANTS),
        Entry("step3p5", EXPERT_VARIANTS),
        Entry("mimo_v2_flash", EXPERT_VARIANTS),
        Entry("laguna", EXPERT_VARIANTS),
        # hybrids: recurrent mixers on some layers (models/universal/mixers/)
        Entry("lfm2"),
        Entry("lfm2-vl"),  # lfm2 behind the VLM wrapper
        Entry("qwen3_5"),
        Entry("qwen3_5_moe", EXPERT_VARIANTS),
        Entry("qwen3_next", EXPERT_VARIANTS),
        Entry("lfm2_moe", EXPERT_VARIANTS),
        Entry("olmo_hybrid"),
        Entry("mamba2"),
        Entry("mamba"),
        Entry("falcon_mamba"),
        Entry("jamba", EXPERT_VARIANTS),  # jamba's Mamba mixer, NoPE attention and MoE layers  # mamba's file (MODEL_REMAPPING) with delta / B / C rms-normed
        Entry("nemotron_h", EXPERT_VARIANTS),  # its E layers route (f16 / bf16: on CUDA)
        Entry("granitemoehybrid"),
        Entry("falcon_h1"),  # mamba2 beside attention in every layer (a CacheList each)
        # dedicated graphs held to mlx-lm (L1), gated like the rows
        Entry("gemma3n", expect_graph="gemma3n"),  # AltUp, LAuReL, per-layer inputs, KV-shared layers
    ]
}


def universal_archs() -> list[str]:
    """The manifest's archs that are descriptor rows (run on the universal graph)."""
    return sorted(a for a, e in MANIFEST.items() if e.expect_graph == "universal-dense")
