"""MLA KV memory and quantized-KV quality: the tables of benchmarks/kv-memory.md's MLA section.

1. Bytes per token per layer of published MLA configs' cache shapes (`kv_bytes`): the latent
   cache (deepseek_v3 / glm4_moe_lite in mlx-lm), the expanded cache (deepseek_v2 / minicpm3)
   and the equivalent MHA, per KV scheme; closed form, and measured (sum of cache.nbytes after a
   prefill / tokens / layers) on a 2-layer universal model with the config's cache-shaping keys
   (heads, kv_lora_rank, nope / rope / v head dims) over the zoo's tiny deepseek_v2 (expanded)
   or deepseek_v3 (latent) recipe; the other keys (hidden size, experts, vocab) do not touch the
   cache and stay tiny.
2. KLD and top-1 agreement vs plain KV (`kv_quality`) on the zoo's MLA checkpoints as built
   and with their head dims widened to multiples of 64 (the zoo's are too narrow for group 64).
   Zoo weights are random: a mechanism check, not a quality claim.

    python -m mlxbun.bench.mla_kv [--configs NAME,...] [--tokens 256] [--no-quality]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlxbun.bench.kv_bytes import GROUP_SIZE, SCHEMES, layout_bytes, measured_bytes, mla_layouts, total_bytes
from mlxbun.bench.kv_quality import QUALITY_SCHEMES, kv_quality
from mlxbun.errors import MlxbunError
from mlxbun.zoo.archs import tiny_config

__all__ = ["CONFIGS", "ZOO_WIDE", "MlaConfig", "bytes_table", "main", "quality_tables", "shape_config"]

# arch whose row caches each layout (a model of that row measures it)
_LAYOUT_ARCH = {"latent": "deepseek_v3", "expanded": "deepseek_v2"}
_SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MlaConfig:
    name: str
    source: str  # where the numbers come from
    cached_as: str  # the layout mlx-lm's model for it caches: latent / expanded
    layers: int
    keys: dict  # the cache-shaping config keys (transformers' names)


CONFIGS = (
    MlaConfig("DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite config.json (q_lora_rank null; not "
              "transformers' DeepseekV2Config defaults)", "expanded", 27,
              dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)),
    MlaConfig("DeepSeek-V3", "transformers' DeepseekV3Config defaults (= deepseek-ai/DeepSeek-V3)", "latent", 61,
              dict(num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)),
    MlaConfig("MiniCPM3-4B", "transformers' MiniCPM3Config defaults (= openbmb/MiniCPM3-4B; v_head_dim = "
              "hidden 2560 / 40 heads)", "expanded", 62,
              dict(num_attention_heads=40, num_key_value_heads=40, kv_lora_rank=256, qk_nope_head_dim=64,
                   qk_rope_head_dim=32, hidden_size=2560)),
    MlaConfig("GLM-4.7-Flash", "transformers' Glm4MoeLiteConfig defaults = mlx-lm glm4_moe_lite ModelArgs "
              "defaults (glm4_moe_lite)", "latent", 47,
              dict(num_attention_heads=20, num_key_value_heads=20, kv_lora_rank=512, qk_nope_head_dim=192,
                   qk_rope_head_dim=64, v_head_dim=256)),
    *(MlaConfig(f"zoo:{a}", f"the zoo's tiny {a} (tiny_config)", kind, 2, dict(tiny_config(a)))
      for a, kind in (("deepseek_v2", "expanded"), ("deepseek_v3", "latent"))),
)

# the zoo's MLA recipes with head dims group 64 divides (the cache's K and V widths)
ZOO_WIDE = {"deepseek_v2": dict(qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, head_dim=32),
            "deepseek_v3": dict(qk_rope_head_dim=64, head_dim=64)}


def shape_config(c: MlaConfig, layout: str) -> dict:
    """A 2-layer config of the row that caches `layout`, with `c`'s cache-shaping keys."""
    arch = _LAYOUT_ARCH[layout]
    dims = mla_layouts(c.keys)["expanded"]
    keys = {k: c.keys[k] for k in _SHAPE_KEYS if k in c.keys}
    heads = keys["num_attention_heads"]
    return {**tiny_config(arch), **keys, "v_head_dim": dims.value_dim, "head_dim": keys["qk_rope_head_dim"],
            "hidden_size": max(64, 2 * heads), "num_hidden_layers": 2}


def _cell(v, group: int, reasons: dict[str, int]) -> str:
    """Bytes (and the group size where not 64), "n/a", or "refused [note]" (`reasons`: reason -> note)."""
    if isinstance(v, int):
        return f"{v:,}" + ("" if group == GROUP_SIZE else f" (g{group})")
    if v.reason.startswith("n/a"):
        return "n/a"
    n = reasons.setdefault(v.reason, len(reasons) + 1)
    return f"{v.reason.split(':')[0]} [{n}]"


def _group(layout, scheme: str) -> int:
    """mlx-lm's default group 64, or 32 where only 32 divides the cache's widths (MiniCPM3)."""
    if isinstance(layout_bytes(layout, scheme, GROUP_SIZE), int):
        return GROUP_SIZE
    return 32 if isinstance(layout_bytes(layout, scheme, 32), int) else GROUP_SIZE


def bytes_table(configs=CONFIGS, tokens: int = 256, measure: bool = True) -> str:
    """Two markdown tables (values per token; bytes per token per layer per scheme) and the
    refusal reasons; with `measure`, every closed form is checked against the caches' bytes."""
    shapes = ["| config | source | mlx-lm caches | layers | latent values/token/layer | "
              "MHA-equivalent values/token/layer | MHA / latent |", "|---|---|---|---:|---|---|---:|"]
    rows = ["| config | layout | " + " | ".join(SCHEMES) + " | measured |",
            "|---|---|" + "---:|" * len(SCHEMES) + "---|"]
    reasons: dict[str, int] = {}
    for c in configs:
        lay = mla_layouts(c.keys)
        lat, mha = lay["latent"], lay["mha"]
        shapes.append(f"| {c.name} | {c.source} | {c.cached_as} | {c.layers} | {lat.values_per_token} "
                      f"({lat.key_dim} latent + {lat.value_dim} rope key) | {mha.values_per_token} "
                      f"({mha.heads} heads x ({mha.key_dim} + {mha.value_dim})) | "
                      f"{mha.values_per_token / lat.values_per_token:.1f}x |")
        for name in ("latent", "expanded", "mha"):
            group = {s: _group(lay[name], s) for s in SCHEMES}
            closed = {s: layout_bytes(lay[name], s, group[s]) for s in SCHEMES}
            check = "-"
            if measure and name in _LAYOUT_ARCH:
                got = {s: measured_bytes(shape_config(c, name), s, tokens, group[s]) for s in SCHEMES}
                bad = [s for s in SCHEMES if isinstance(got[s], int) != isinstance(closed[s], int)
                       or (isinstance(got[s], int) and got[s] != closed[s])]
                if bad:
                    raise MlxbunError(f"{c.name} {name}: measured {[got[s] for s in bad]} != closed form "
                                      f"{[closed[s] for s in bad]} for {bad}")
                check = f"= closed form ({tokens} tokens)"
            elif name == "mha":
                check = "(byte for byte the expanded cache)"
            label = f"**{name}**" if name == c.cached_as else name
            rows.append(f"| {c.name} | {label} | " + " | ".join(_cell(closed[s], group[s], reasons) for s in SCHEMES)
                        + f" | {check} |")
    notes = "\n".join(f"[{n}] {r.split(': ', 1)[1]}" for r, n in reasons.items())
    return ("\n".join(shapes) + "\n\nBytes per token per layer:\n\n" + "\n".join(rows) + "\n\n" + notes
            + "\n\n" + totals_table(configs, reasons))


def totals_table(configs=CONFIGS, reasons: dict[str, int] | None = None) -> str:
    """KiB per token over all layers, and GiB for a 32k-token context, per scheme: the layout
    mlx-lm caches for the config, and the equivalent MHA."""
    reasons = {} if reasons is None else reasons
    ctx = 32768
    lines = ["| config | layout | " + " | ".join(f"{s} KiB/token" for s in SCHEMES)
             + f" | 16bit GiB at {ctx // 1024}k tokens |", "|---|---|" + "---:|" * (len(SCHEMES) + 1)]
    for c in configs:
        lay = mla_layouts(c.keys)
        for name in dict.fromkeys((c.cached_as, "mha")):
            cells = []
            for s in SCHEMES:
                group = _group(lay[name], s)
                t = total_bytes(lay[name], s, c.layers, group)
                cells.append(_cell(t, group, reasons) if not isinstance(t, int)
                             else f"{t / 1024:,.1f}" + ("" if group == GROUP_SIZE else f" (g{group})"))
            gib = total_bytes(lay[name], "16bit", c.layers) * ctx / 2**30
            lines.append(f"| {c.name} | {name} | " + " | ".join(cells) + f" | {gib:,.2f} |")
    return "Per token over all layers (TurboQuant: the last layer at 16 bits, mlx-vlm's rule):\n\n" + "\n".join(lines)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def quality_tables(prompt_tokens: int = 64, continuation: int = 128, schemes=QUALITY_SCHEMES, zoo_root=None) -> str:
    """KLD / top-1 vs plain KV on zoo:deepseek_v2 / zoo:deepseek_v3, as built and widened."""
    from mlxbun.models.universal.loader import load_universal
    from mlxbun.parity.forced import eval_ids
    from mlxbun.tokenizer import load_tokenizer
    from mlxbun.zoo import build
    from mlxbun.zoo.registry import cached_checkpoint

    lines = ["| model (cache K / V widths) | scheme | KV bytes vs plain | KLD mean | KLD p99 | KLD max | top-1 agreement |",
             "|---|---|---:|---:|---:|---:|---:|"]
    refusals: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("deepseek_v2", "deepseek_v3"):
            wide = Path(tmp) / arch
            wide.mkdir()
            build.build_files(build.variant(arch), wide, ZOO_WIDE[arch])
            for name, path in ((f"zoo:{arch}", cached_checkpoint(arch, root=zoo_root)),
                               (f"zoo:{arch} widened", wide)):
                model, tok = load_universal(path), load_tokenizer(path)
                lay = mla_layouts(model.raw_config)["latent" if model.latent_kv else "expanded"]
                label = f"{name} ({lay.key_dim} / {lay.value_dim})"
                own = [s for s in schemes if model.latent_kv or not s.endswith("-latent")]
                plain, rows = kv_quality(model, eval_ids(tok, prompt_tokens), continuation, own)
                for r in rows:
                    if r.refused:
                        refusals.setdefault(r.refused, []).append(f"{label} {r.scheme}")
                        lines.append(f"| {label} | {r.scheme} | refused | - | - | - | - |")
                        continue
                    lines.append(f"| {label} | {r.scheme} | {r.kv_bytes / plain:.3f} | {_fmt(r.kld_mean, '.2e')} | "
                                 f"{_fmt(r.kld_p99, '.2e')} | {_fmt(r.kld_max, '.2e')} | {r.top1:.3f} |")
    notes = "\n".join(f"- {', '.join(where)}: {why}" for why, where in refusals.items())
    return "\n".join(lines) + "\n\nRefused:\n\n" + notes


def main(argv=None) -> int:
    import mlx.core as mx

    p = argparse.ArgumentParser(prog="python -m mlxbun.bench.mla_kv", description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="comma-separated config names (default: all)")
    p.add_argument("--tokens", type=int, default=256, help="prefill tokens of the measurement (multiple of 256)")
    p.add_argument("--no-measure", action="store_true", help="closed forms only")
    p.add_argument("--no-quality", action="store_true", help="skip the zoo KLD tables")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the KLD run")
    p.add_argument("--continuation", type=int, default=128, help="greedy continuation tokens compared")
    p.add_argument("--zoo-root", help="zoo checkpoint cache (default: $MLXBUN_ZOO_CACHE or ~/.cache/mlxbun/zoo)")
    args = p.parse_args(argv)
    known = {c.name: c for c in CONFIGS}
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {', '.join(known)}")
    print(f"device: {mx.default_device()}\n")
    print(bytes_table([known[n] for n in names], args.tokens, not args.no_measure))
    if not args.no_quality:
        print(f"\nKLD vs plain KV: prompt {args.prompt} tokens of the zoo corpus + its greedy continuation of "
              f"{args.continuation} tokens, teacher-forced (float32 zoo weights, random):\n")
        print(quality_tables(args.prompt, args.continuation, zoo_root=args.zoo_root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
