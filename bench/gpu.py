"""GPU check and benchmark for a CUDA machine, in one run (under 8 minutes on one GPU).

    .venv/bin/python bench/gpu.py [--quick]

1. Correctness: each Triton kernel (store_kv, paged_decode_attention, paged_prefill_attention)
   against the torch reference in float64, fp16 and bf16 inputs, GQA ratios 1 and 4.
2. Kernel timings with CUDA events: decode attention's achieved bytes/s against a measured
   device-to-device copy bandwidth; prefill attention's FLOP/s at 8,192 x 8,192 causal, 512
   new tokens over 8,192 cached, and 16 sequences of 512 tokens. The prefill kernel's result
   for a prompt in one call and in chunks must be bitwise equal (a check that fails the run).
3. The engine end to end on a random-weight model with a Llama-3-8B shape (bf16): cold TTFT at
   2,000 and 8,000 tokens with its model FLOP utilisation (model FLOPs / time / the bf16 rate of
   a large product measured in the same run), warm TTFT for a question after the 8,000-token
   manual, and decode tokens/s at batch 1 and 32, its decode steps replayed from CUDA graphs:
   graph-replayed logits bitwise equal to the same padded steps run eagerly (a check that
   fails the run), batch-1 decode eager beside; graph memory and the activation reserve,
   measured and planned.
5. Batch invariance (``--batch-invariant``) on a random-weight model of Llama-3-8B width with 4
   layers, its fast path beside it: for 4 questions after a 3,000-token manual, the next-token
   logits of 16 decode steps bitwise equal cold against warm, alone against batched with 7
   other requests, and with the prompt chunked at three token budgets (a check that fails the
   run for the invariant path); and the invariant path's cost: cold TTFT and decode tokens/s
   at batch 1 and 32, each against the fast path's.
4. An fp8 (e4m3) KV cache against bf16 KV: the attention kernels' relative error over the same
   keys and values, the store's bits against torch's conversion, and on the random-weight
   model greedy agreement of 8 answers of 32 tokens and the pool's capacity in tokens (one
   engine at a time, each given 40% of the device).

Prints one table and writes JSON under bench/results/gpu-<date>.json.

``--dry-run`` runs the same script on the CPU with tiny shapes under Triton's interpreter
(fp16/fp32 only: the interpreter's bf16 arithmetic is not exact), so it is known to start.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def ref_attention(q, k_cache, v_cache, tables, seq_lens, q_lens, scale):
    _, bs, kvh, d = k_cache.shape
    heads = q.shape[1]
    group = heads // kvh
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    row = 0
    for i, (sl, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        blocks = tables[i, : -(-sl // bs)].long()
        keys = k_cache[blocks].reshape(-1, kvh, d)[:sl].double()
        vals = v_cache[blocks].reshape(-1, kvh, d)[:sl].double()
        keys = keys.repeat_interleave(group, dim=1)  # [sl, heads, d]
        vals = vals.repeat_interleave(group, dim=1)
        qs = q[row : row + ql].double()  # [ql, heads, d]
        s = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        pos = torch.arange(sl - ql, sl, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(sl, device=q.device)[None, :] > pos, float("-inf"))
        out[row : row + ql] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vals)
        row += ql
    return out


def random_tables(lens, bs, num_blocks, device):
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    return table.to(device)


def check_kernels(ta, dev, dry: bool) -> list[dict]:
    rows = []
    dtypes = [torch.float16, torch.float32] + ([] if dry else [torch.bfloat16])
    for dtype in dtypes:
        for heads, kvh in ((4, 4), (8, 2)) if dry else ((8, 8), (32, 8)):
            d, bs = (32, 16) if dry else (128, 16)
            lens = [1, 37, 70] if dry else [1, 37, 700, 2049]
            nb = sum(-(-n // bs) for n in lens) + 8
            kc = torch.randn(nb, bs, kvh, d, device=dev).to(dtype)
            vc = torch.randn(nb, bs, kvh, d, device=dev).to(dtype)
            tables = random_tables(lens, bs, nb, dev)
            sl = torch.tensor(lens, dtype=torch.int32, device=dev)
            q = torch.randn(len(lens), heads, d, device=dev).to(dtype)
            out = torch.full_like(q, float("nan"))
            ta.paged_decode_attention(q, kc, vc, tables, sl, d**-0.5, out=out)
            ref = ref_attention(q, kc, vc, tables, lens, [1] * len(lens), d**-0.5)
            rows.append(
                {
                    "kernel": "paged_decode_attention",
                    "dtype": str(dtype).split(".")[1],
                    "gqa": heads // kvh,
                    "rel_err": rel_err(out, ref),
                    "all_written": not bool(torch.isnan(out).any()),
                }
            )
            q_lens = [1, 20, 9] if dry else [1, 37, 300, 49]
            qp = torch.randn(sum(q_lens), heads, d, device=dev).to(dtype)
            cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            out = torch.full_like(qp, float("nan"))
            ta.paged_prefill_attention(qp, kc, vc, tables, cu.to(dev), sl, d**-0.5, out=out)
            ref = ref_attention(qp, kc, vc, tables, lens, q_lens, d**-0.5)
            rows.append(
                {
                    "kernel": "paged_prefill_attention",
                    "dtype": str(dtype).split(".")[1],
                    "gqa": heads // kvh,
                    "rel_err": rel_err(out, ref),
                    "all_written": not bool(torch.isnan(out).any()),
                }
            )
            key = torch.randn(50, kvh, d, device=dev).to(dtype)
            slots = torch.randperm(nb * bs, device=dev)[:50]
            slots[::7] = -1
            k2, v2 = kc.clone(), vc.clone()
            ta.store_kv(key, key, k2, v2, slots)
            keep = slots >= 0
            exp = kc.clone()
            exp.view(-1, kvh, d)[slots[keep]] = key[keep]
            # a prompt's tokens in one call and in chunks over the cached start: bitwise equal
            # (key tiles fixed from position 0; a tile past a row changes nothing)
            n = 70 if dry else 2900
            ctab = random_tables([n], bs, nb, dev) if n <= nb * bs else None
            if ctab is not None:
                qc = torch.randn(n, heads, d, device=dev).to(dtype)

                def run(a, b, qc=qc, ctab=ctab, kc=kc, vc=vc, d=d):
                    cu2 = torch.tensor([0, b - a], dtype=torch.int32, device=dev)
                    sl2 = torch.tensor([b], dtype=torch.int32, device=dev)
                    return ta.paged_prefill_attention(qc[a:b], kc, vc, ctab, cu2, sl2, d**-0.5)

                whole = run(0, n)
                same = all(
                    torch.equal(
                        torch.cat([run(a, b) for a, b in zip(c, c[1:], strict=False)]), whole
                    )
                    for c in ([0, n // 3, n], [0, 1, 17, n - 1, n])
                )
                rows.append(
                    {
                        "kernel": "prefill_chunks_bitwise",
                        "dtype": str(dtype).split(".")[1],
                        "gqa": heads // kvh,
                        # the interpreter's products are numpy's, whose rounding depends on a
                        # row's place in the block: checked bitwise on a GPU only
                        "rel_err": 0.0 if same or dry else 1.0,
                        "all_written": True,
                    }
                )
            rows.append(
                {
                    "kernel": "store_kv",
                    "dtype": str(dtype).split(".")[1],
                    "gqa": heads // kvh,
                    "rel_err": 0.0 if torch.equal(k2, exp) else 1.0,
                    "all_written": True,
                }
            )
    return rows


def cuda_time(fn, iters=20) -> float:
    """Median milliseconds of fn() by CUDA events (wall clock on a CPU dry run)."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def peak_matmul_tflops(dev, dry: bool) -> float:
    """The device's 16-bit product rate (one large square product), for FLOP utilisations."""
    m = 256 if dry else 8192
    mat = torch.randn(m, m, device=dev, dtype=torch.float16 if dry else torch.bfloat16)
    return 2 * m**3 / (cuda_time(lambda: mat @ mat, iters=10) / 1000) / 1e12


def time_kernels(ta, dev, dry: bool) -> dict:
    x = torch.empty(1 << (20 if dry else 28), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_ms = cuda_time(lambda: y.copy_(x))
    copy_bw = 2 * x.numel() / (copy_ms / 1000)  # read + write
    out = {"copy_bandwidth_GBps": copy_bw / 1e9}
    out["peak_matmul_TFLOPs"] = peak_matmul_tflops(dev, dry)
    kvh, heads, d, bs = (2, 4, 32, 16) if dry else (8, 32, 128, 16)
    dtype = torch.float16 if dry else torch.bfloat16
    for batch, ctx in ((2, 64),) if dry else ((32, 8192), (64, 2048)):
        nb = batch * ctx // bs + 16
        kc = torch.randn(nb, bs, kvh, d, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        tables = torch.arange(batch * ctx // bs, dtype=torch.int32, device=dev).view(batch, -1)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, d, device=dev, dtype=dtype)
        ms = cuda_time(lambda: ta.paged_decode_attention(q, kc, vc, tables, sl, d**-0.5))  # noqa: B023
        bytes_read = 2 * batch * ctx * kvh * d * 2
        out[f"decode_b{batch}_ctx{ctx}_ms"] = ms
        out[f"decode_b{batch}_ctx{ctx}_GBps"] = bytes_read / (ms / 1000) / 1e9
        out[f"decode_b{batch}_ctx{ctx}_of_copy_bw"] = bytes_read / (ms / 1000) / copy_bw
        del kc, vc
    # 16 sequences of 512 new tokens each, no cache (the varlen batch)
    seqs, n16 = (2, 32) if dry else (16, 512)
    nb = seqs * n16 // bs + 16
    kc = torch.randn(nb, bs, kvh, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.arange(seqs * n16 // bs, dtype=torch.int32, device=dev).view(seqs, -1)
    sl = torch.full((seqs,), n16, dtype=torch.int32, device=dev)
    cu = torch.arange(0, (seqs + 1) * n16, n16, dtype=torch.int32, device=dev)
    q = torch.randn(seqs * n16, heads, d, device=dev, dtype=dtype)
    ms = cuda_time(lambda: ta.paged_prefill_attention(q, kc, vc, tables, cu, sl, d**-0.5), 10)
    flops = 4 * seqs * (n16 * (n16 + 1) / 2) * heads * d
    out[f"prefill_{seqs}x{n16}_ms"] = ms
    out[f"prefill_{seqs}x{n16}_TFLOPs"] = flops / (ms / 1000) / 1e12
    del kc, vc
    for ctx, new in ((64, 32),) if dry else ((8192, 8192), (8192, 512)):
        nb = ctx // bs + 16
        kc = torch.randn(nb, bs, kvh, d, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        tables = torch.arange(ctx // bs, dtype=torch.int32, device=dev).view(1, -1)
        sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, new], dtype=torch.int32, device=dev)
        q = torch.randn(new, heads, d, device=dev, dtype=dtype)
        ms = cuda_time(
            lambda: ta.paged_prefill_attention(q, kc, vc, tables, cu, sl, d**-0.5),  # noqa: B023
            iters=10,
        )
        # causal pairs: new queries over (ctx - new) cached keys plus a triangle
        pairs = new * (ctx - new) + new * (new + 1) / 2
        flops = 4 * pairs * heads * d
        out[f"prefill_ctx{ctx}_new{new}_ms"] = ms
        out[f"prefill_ctx{ctx}_new{new}_TFLOPs"] = flops / (ms / 1000) / 1e12
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_flops(config: dict, n: int) -> float:
    """FLOPs of a prompt of n tokens through the model: the layers' products (2 per weight and
    token), causal attention (2 n^2 head_dim per head and layer) and one token's logits."""
    from inference.kv_planner import ModelShape

    shape = ModelShape.from_config(config)
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    layers = shape.num_params() - embeddings
    attention = 2 * shape.num_layers * shape.num_heads * shape.head_dim * n * n
    return 2 * n * layers + attention + 2 * shape.vocab_size * shape.hidden_size


def engine_bench(quick: bool, dry: bool) -> dict:
    from inference import LLM, SamplingParams
    from inference.model.model_import import import_default_model

    tmp = Path(tempfile.mkdtemp(prefix="docqa-gpu-"))
    (tmp / "config.json").write_text(json.dumps(TINY if dry else LLAMA3_8B))
    src = import_default_model()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp / f)
    t0 = time.perf_counter()
    kwargs = {"attention_backend": "triton"}
    if dry:
        kwargs.update(dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=256)
    else:  # decode steps replayed from CUDA graphs (checked against eager below)
        kwargs.update(dtype="bfloat16", max_num_batched_tokens=8192, cuda_graphs=True)
    llm = LLM(tmp, random_weights_seed=0, **kwargs)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    gen = torch.Generator().manual_seed(0)
    manual_len = 200 if dry else 8000
    manual = torch.randint(100, 40000, (manual_len,), generator=gen).tolist()

    def ttft(ids, use_cache=True):
        sync()
        out = llm.generate(
            prompt_token_ids=[ids],
            sampling_params=SamplingParams(max_tokens=1),
            use_cache=use_cache,
        )[0]
        return out.metrics.ttft_ms, out.num_cached_tokens

    q = lambda i: manual + torch.randint(100, 40000, (40,), generator=gen).tolist()  # noqa: E731
    ttft(q(0), use_cache=False)  # warm-up (kernel compilation)
    cold_ms, _ = ttft(q(1), use_cache=False)
    short = manual_len // 4  # 2,000 tokens
    cold_short_ms, _ = ttft(manual[:short], use_cache=False)
    ttft(q(2))  # puts the manual in the cache
    warm_ms, cached = ttft(q(3))
    res = {
        "model": "random weights, tiny (dry run)" if dry else "random weights, Llama-3-8B shape",
        "load_s": load_s,
        "kv_capacity_tokens": eng.kv_spec.num_tokens,
        f"cold_ttft_ms_{short}": cold_short_ms,
        f"model_GFLOP_{short}": model_flops(TINY if dry else LLAMA3_8B, short) / 1e9,
        f"cold_ttft_ms_{manual_len}": cold_ms,
        f"model_GFLOP_{manual_len}": model_flops(TINY if dry else LLAMA3_8B, manual_len + 40) / 1e9,
        f"warm_ttft_ms_{manual_len}": warm_ms,
        "warm_cached_tokens": cached,
    }
    for batch in (1, 4) if dry else (1, 32):
        n_out = 4 if dry else 16 if quick else 64
        plen = 40 if dry else 512
        prompts = [torch.randint(100, 40000, (plen,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=n_out, ignore_eos=True)
        reqs = [eng.add_request(p, params) for p in prompts]
        while any(r.times.first_token is None for r in reqs):
            eng.step()
        sync()
        t0 = time.perf_counter()
        steps0 = eng.num_steps
        while any(not r.finished for r in reqs):
            eng.step()
        sync()
        dt_s = time.perf_counter() - t0
        tokens = batch * (eng.num_steps - steps0)
        for r in reqs:
            eng.release(r)
        res[f"decode_tok_s_batch{batch}"] = tokens / dt_s
    runner = eng.runner
    if getattr(runner, "decode_mode", None) == "graphs":
        # graph-replayed decode steps against the same padded steps run eagerly (the same
        # matrix shapes: a 5-sequence step is 8 rows either way): the same logits, bitwise
        # (the run fails if not); and batch-1 decode eager, unpadded, beside the graphs'
        # figure above
        prompts = [torch.randint(100, 40000, (200,), generator=gen).tolist() for _ in range(5)]
        logits = {}
        for mode in ("graphs", "eager-padded"):
            runner.decode_mode = mode
            reqs = [
                eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True), keep_logits=True)
                for p in prompts
            ]
            while any(not r.finished for r in reqs):
                eng.step()
            logits[mode] = [torch.stack(r.logits) for r in reqs]
            for r in reqs:
                eng.release(r)
        res["graphs_vs_eager_logits_equal"] = all(
            torch.equal(a, b) for a, b in zip(logits["graphs"], logits["eager-padded"], strict=True)
        )
        runner.decode_mode = "eager"
        reqs = [eng.add_request(prompts[0], SamplingParams(max_tokens=32, ignore_eos=True))]
        while reqs[0].times.first_token is None:
            eng.step()
        sync()
        t0, s0 = time.perf_counter(), eng.num_steps
        while not reqs[0].finished:
            eng.step()
        sync()
        res["decode_tok_s_batch1_eager"] = (eng.num_steps - s0) / (time.perf_counter() - t0)
        eng.release(reqs[0])
        runner.decode_mode = "graphs"
        res["graph_MiB"] = runner.graphs.bytes / 2**20
    res["activation_reserve_measured_MiB"] = (runner.reserve.measured_bytes or 0) / 2**20
    res["activation_reserve_planned_MiB"] = runner.reserve.planned_bytes / 2**20
    eng.close()
    return res


def kv8_bench(ta, dev, dry: bool) -> dict:
    """Section 4 (module docstring)."""
    import gc

    from inference import LLM, SamplingParams, kv_quant

    gc.collect()  # the engine of section 3 and its pool: back to the device first
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    from inference.model.model_import import import_default_model

    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.float16 if dry else torch.bfloat16
    heads, kvh, d, bs = (4, 2, 32, 16) if dry else (32, 8, 128, 16)
    lens = [70, 33, 150] if dry else [4000, 700, 9000]
    nb = sum(-(-n // bs) for n in lens) + 2
    res: dict = {}
    c16, caches = [], []
    for _ in range(2):
        x = torch.randn(nb, bs, kvh, d, generator=gen) * 2
        scale = kv_quant.pow2_scales(x.abs().amax(dim=(0, 1)), kv_quant.FP8)
        c = kv_quant.quantize(x, 1.0 / scale, kv_quant.FP8).to(dev)
        kv_quant.attach(c, scale.to(dev), (1.0 / scale).to(dev))
        caches.append(c)
        c16.append(x.to(dtype).to(dev))
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(lens), max(-(-n // bs) for n in lens), dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        table[i, :k] = perm[at : at + k]
        at += k
    table, sl = table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype).to(dev)
    o8 = ta.paged_decode_attention(q, caches[0], caches[1], table, sl, d**-0.5)
    o16 = ta.paged_decode_attention(q, c16[0], c16[1], table, sl, d**-0.5)
    res["fp8_vs_bf16_decode_attention_rel_err"] = float(
        (o8.double() - o16.double()).norm() / o16.double().norm()
    )
    key = (torch.randn(64, kvh, d, generator=gen) * 3).to(dtype).to(dev)
    slots = torch.arange(64, device=dev)
    k8 = torch.zeros(4, bs, kvh, d, dtype=kv_quant.FP8, device=dev)
    v8 = torch.zeros_like(k8)
    for c in (k8, v8):
        kv_quant.attach(c, kv_quant.scales_of(caches[0])[0], kv_quant.scales_of(caches[0])[1])
    ta.store_kv(key, key, k8, v8, slots)
    want = kv_quant.quantize(key.float(), kv_quant.scales_of(caches[0])[1], kv_quant.FP8)
    res["fp8_store_bits_equal"] = bool(
        torch.equal(kv_quant.raw(k8).view(-1, kvh, d)[:64], kv_quant.raw(want))
    )

    tmp = Path(tempfile.mkdtemp(prefix="docqa-gpu-kv8-"))
    (tmp / "config.json").write_text(json.dumps(TINY if dry else LLAMA3_8B))
    src = import_default_model()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp / f)
    n, plen = (3, 40) if dry else (8, 300)
    prompts = [torch.randint(100, 40000, (plen,), generator=gen).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=8 if dry else 32, ignore_eos=True)
    answers = {}
    for kv in (None, "fp8"):
        kwargs = {"attention_backend": "triton", "kv_dtype": kv}
        if dry:
            kwargs.update(dtype="float32", kv_cache_gib=0.01)
        else:
            kwargs.update(dtype="bfloat16", gpu_memory_utilization=0.4)
        llm = LLM(tmp, random_weights_seed=0, **kwargs)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_cache=False)
        answers[kv] = [o.token_ids for o in outs]
        res[f"kv_capacity_tokens_{kv or 'bf16'}"] = llm.engine.kv_spec.num_tokens
        res[f"kv_bytes_per_token_{kv or 'bf16'}"] = llm.engine.kv_spec.bytes_per_token
        llm.engine.close()
        del llm, outs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(answers[None], answers["fp8"], strict=True))
    res["fp8_greedy_answers_equal"] = f"{same}/{len(prompts)}"
    return res


def invariance_bench(dry: bool) -> dict:
    """Section 5 (module docstring)."""
    import gc

    from inference import LLM, SamplingParams
    from inference.model.model_import import import_default_model

    cfg = dict(TINY) if dry else {**LLAMA3_8B, "num_hidden_layers": 4}
    tmp = Path(tempfile.mkdtemp(prefix="docqa-gpu-inv-"))
    (tmp / "config.json").write_text(json.dumps(cfg))
    src = import_default_model()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp / f)
    gen = torch.Generator().manual_seed(1)
    manual_len, q_len, steps = (48, 5, 3) if dry else (3000, 40, 16)
    manual = torch.randint(100, 40000, (manual_len,), generator=gen).tolist()
    questions = [
        manual + torch.randint(100, 40000, (q_len,), generator=gen).tolist() for _ in range(4)
    ]
    other_len = 16 if dry else 300
    others = [torch.randint(100, 40000, (other_len,), generator=gen).tolist() for _ in range(7)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    budgets = (16, 32, 64) if dry else (512, 2048, 8192)
    res: dict = {}

    def engine(invariant: bool, budget: int):
        kw = {"attention_backend": "triton", "batch_invariant": invariant}
        if dry:
            kw.update(dtype="float32", kv_cache_gib=0.02, max_num_batched_tokens=budget)
        else:
            kw.update(dtype="bfloat16", gpu_memory_utilization=0.3, max_num_batched_tokens=budget)
        return LLM(tmp, random_weights_seed=0, **kw).engine

    def run(eng, prompts, use_cache=True):
        reqs = [eng.add_request(p, params, use_cache=use_cache, keep_logits=True) for p in prompts]
        while any(not r.finished for r in reqs):
            eng.step()
        for r in reqs:
            eng.release(r)
        return reqs

    def same(a, b) -> tuple[int, int]:
        rows = [
            torch.equal(x, y)
            for ra, rb in zip(a, b, strict=True)
            for x, y in zip(ra.logits, rb.logits, strict=True)
        ]
        return sum(rows), len(rows)

    for invariant in (False, True):
        label = "invariant" if invariant else "fast"
        by_budget = []
        for budget in budgets:
            eng = engine(invariant, budget)
            cold = run(eng, questions, use_cache=False) if budget == budgets[-1] else None
            run(eng, questions[:1])  # the manual cached
            warm = [run(eng, [q])[0] for q in questions]
            by_budget.append(warm)
            if cold is not None:
                eq, n = same(cold, warm)
                res[f"{label}_cold_vs_warm_rows_equal"] = f"{eq}/{n}"
                batched = run(eng, questions[:1] + others, use_cache=False)[:1]
                eq, n = same(cold[:1], batched)
                res[f"{label}_alone_vs_batched_rows_equal"] = f"{eq}/{n}"
                tokens = all(
                    a.output_token_ids == b.output_token_ids
                    for a, b in zip(cold, warm, strict=True)
                )
                res[f"{label}_greedy_cold_vs_warm_equal"] = tokens
                # the cost: cold TTFT and decode at batch 1 and 32
                sync()
                t0 = time.perf_counter()
                run(eng, [questions[0][: manual_len // 2]], use_cache=False)
                sync()
                res[f"{label}_cold_prefill_ms"] = (time.perf_counter() - t0) * 1000
                for batch in (1, 4) if dry else (1, 32):
                    reqs = [eng.add_request(others[i % 7], params, use_cache=False)
                            for i in range(batch)]  # fmt: skip
                    while any(r.times.first_token is None for r in reqs):
                        eng.step()
                    sync()
                    t0, s0 = time.perf_counter(), eng.num_steps
                    while any(not r.finished for r in reqs):
                        eng.step()
                    sync()
                    dt_s = time.perf_counter() - t0
                    res[f"{label}_decode_tok_s_batch{batch}"] = batch * (eng.num_steps - s0) / dt_s
                    for r in reqs:
                        eng.release(r)
            eng.close()
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        eq = [same(by_budget[0], b) for b in by_budget[1:]]
        res[f"{label}_chunked_rows_equal"] = f"{sum(e for e, _ in eq)}/{sum(n for _, n in eq)}"
    for k in ("cold_prefill_ms",):
        res[f"invariant_over_fast_{k}"] = res[f"invariant_{k}"] / res[f"fast_{k}"]
    for batch in (1, 4) if dry else (1, 32):
        k = f"decode_tok_s_batch{batch}"
        res[f"invariant_over_fast_{k}"] = res[f"invariant_{k}"] / res[f"fast_{k}"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer decode steps")
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU under the interpreter"
    )
    ap.add_argument("--out", help="JSON path (default: bench/results/gpu-<date>.json)")
    ap.add_argument(
        "--sections",
        default="checks,timings,engine,kv8,invariance",
        help="which sections to run, comma-separated (default: all; checks always run)",
    )
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    elif not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    from types import SimpleNamespace

    from inference.kernels.triton import common, decode_attention, kv_store, prefill_attention

    ta = SimpleNamespace(
        paged_decode_attention=decode_attention.paged_decode_attention,
        paged_prefill_attention=prefill_attention.paged_prefill_attention,
        store_kv=kv_store.store_kv,
        LAUNCHES=common.LAUNCHES,
    )

    dev = torch.device("cpu" if args.dry_run else "cuda")
    t_all = time.perf_counter()
    sections = set(args.sections.split(","))
    checks = check_kernels(ta, dev, args.dry_run)
    timings = time_kernels(ta, dev, args.dry_run) if "timings" in sections else {}
    engine = engine_bench(args.quick, args.dry_run) if "engine" in sections else {}
    engine["kernel_launches"] = dict(ta.LAUNCHES)
    peak = timings.get("peak_matmul_TFLOPs") or peak_matmul_tflops(dev, args.dry_run)
    for key in [k for k in engine if k.startswith("model_GFLOP_")]:
        n = key.rsplit("_", 1)[1]
        cold = engine[f"cold_ttft_ms_{n}"]
        # model FLOP utilisation of the cold TTFT: model FLOPs / time / the measured peak
        engine[f"cold_ttft_mfu_{n}"] = engine[key] * 1e9 / (cold / 1000) / (peak * 1e12)
    kv8 = kv8_bench(ta, dev, args.dry_run) if "kv8" in sections else {}
    ok_kv8 = not kv8 or (
        kv8["fp8_store_bits_equal"] and kv8["fp8_vs_bf16_decode_attention_rel_err"] < 0.1
    )
    inv = invariance_bench(args.dry_run) if "invariance" in sections else {}

    def all_equal(v: str) -> bool:
        eq, n = map(int, v.split("/"))
        return eq == n

    # the invariant path's promise (bitwise on a GPU; the interpreter's products are numpy's,
    # whose rounding depends on a row's place in the block: reported, not enforced there)
    ok_inv = (
        args.dry_run
        or not inv
        or (
            inv["invariant_greedy_cold_vs_warm_equal"]
            and all(
                all_equal(inv[f"invariant_{k}_rows_equal"])
                for k in ("cold_vs_warm", "alone_vs_batched", "chunked")
            )
        )
    )
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
    print("| check | dtype | GQA | rel err | ok |")
    print("|---|---|---|---|---|")
    ok_all = True
    for c in checks:
        ok = c["all_written"] and c["rel_err"] < tol[c["dtype"]]
        ok_all &= ok
        print(f"| {c['kernel']} | {c['dtype']} | {c['gqa']} | {c['rel_err']:.2e} | {ok} |")
    ok_all &= ok_kv8 and ok_inv and engine.get("graphs_vs_eager_logits_equal", True)
    print("\n| measure | value |\n|---|---|")
    shown = {
        **timings,
        **{k: v for k, v in engine.items() if k != "kernel_launches"},
        **kv8,
        **inv,
    }
    for k, v in shown.items():
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"gpu-{dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "checks": checks,
                "kernels": timings,
                "engine": engine,
                "kv8": kv8,
                "batch_invariance": inv,
                "seconds": time.perf_counter() - t_all,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out} in {time.perf_counter() - t_all:.0f} s")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
