"""PyTorch's CPU scaled_dot_product_attention decoding one token over a KV cache, the shape
`ctxpar bench decode` times: q [1, Hq, 1, D] against k, v [1, Hkv, T, D] (torch's layout,
contiguous; enable_gqa shares each KV head among its Hq / Hkv query heads). Prints one JSON
object: per dtype and context the median seconds of --repeats calls and the cache's bytes/s
(K and V bytes / time, as ctxpar's figure). Run it beside `ctxpar bench decode`, alternating:

    .venv/bin/python bench/torch_decode.py --context 32768,131072 --dtype fp32,bf16 --threads 1
"""
import argparse
import json
import statistics
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", default="32768,131072", help="cached tokens, comma-separated")
    p.add_argument("--dtype", default="fp32,bf16", help="fp32 | bf16, comma-separated")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}")
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(a.threads)
    types = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for name in a.dtype.split(","):
        if name not in types:
            p.error(f"--dtype: fp32 or bf16, got {name!r}")
        for t in (int(x) for x in a.context.split(",")):
            g = torch.Generator().manual_seed(1)
            k = torch.randn(1, a.kv_heads, t, a.head_dim, generator=g).to(types[name])
            v = torch.randn(1, a.kv_heads, t, a.head_dim, generator=g).to(types[name])
            q = torch.randn(1, a.heads, 1, a.head_dim, generator=g).to(types[name])
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # warm-up
                times = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            nbytes = 2 * t * a.kv_heads * a.head_dim * k.element_size()
            rows.append(dict(dtype=name, context=t, seconds=s, bytes_per_second=nbytes / s))
            del k, v
    print(json.dumps(dict(torch=torch.__version__, heads=a.heads, kv_heads=a.kv_heads,
                          head_dim=a.head_dim, threads=a.threads, repeats=a.repeats, rows=rows)))


if __name__ == "__main__":
    main()
