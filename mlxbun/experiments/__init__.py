"""One driver per standard notebook: what the notebook computes, as library code with tests.

| module           | notebook                    | entry point                               |
|------------------|-----------------------------|-------------------------------------------|
| `port_bringup`   | notebooks/port_bringup      | `bringup(model)` -> `Bringup`             |
| `logit_diff`     | notebooks/logit_diff        | `logit_diff(Side(...), Side(...))`        |
| `kv_quant`       | notebooks/kv_quant          | `kv_sweep(model, kv_grid(...))`           |
| `benchmark`      | notebooks/benchmark         | `benchmark(model)` -> `Benchmark`         |
| `spec_acceptance`| notebooks/spec_acceptance   | `spec_sweep(model, drafters, ks)`         |
| `diffusion`      | notebooks/diffusion         | `diffusion_sweep(model, prompts)`         |
| `moe_routing`    | notebooks/moe_routing       | `moe_routing(Side(...), Side(...))`       |

Dependencies run one way: experiments -> features (speculative, diffusion, cache, parity, bench)
-> core (models, config, weights, tokenizer); experiments also use `mlxbun.lab` (plots,
recording). No feature module imports an experiment. Each driver writes its rows to the results
table under the notebook's name, and each plot it offers is built from `mlxbun.lab.plots`.
"""
