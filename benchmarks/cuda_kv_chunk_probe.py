import mlx.core as mx
from mlx.utils import tree_map
import mlxbun.cache.quantized as Q
from mlxbun.bench.kv_memory import KV_HEAVY, run_kv_memory, to_markdown
from mlxbun.models.universal.loader import build_model
model = build_model(dict(KV_HEAVY))
mx.random.seed(0)
model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.float16), model.parameters()))
mx.eval(model.parameters())
for chunk in (2048, 4096, 8192, 1 << 20):
    Q.CUDA_ATTENTION_CHUNK = chunk
    rows = run_kv_memory(model, (16384,), ("fp16", "q8", "q4"), 16)
    print(f"CUDA_ATTENTION_CHUNK={chunk}")
    print(to_markdown(rows))
