"""What an 8-bit KV cache costs in answer quality: the real default model with int8 and fp8 KV
against 16-bit KV, side by side in one run.

    .venv/bin/python bench/kv_quality.py [--max-tokens 48]

For the bundled manual and the tests' manuals (plus, where the machine has them, two long
license texts):
- the perplexity of the manual's own text (every next token, the manual as one prompt) and of
  reference answers (the 16-bit engine's greedy answers to a set of questions, scored token by
  token after their prompt): the ratio exp(mean NLL with 8-bit KV - mean NLL with 16-bit KV);
- greedy agreement: the share of questions whose whole greedy answer is the same tokens as with
  16-bit KV, and the share of answer tokens before the first difference;
- as a yardstick for both, the same measures of the model computed in float32 (its KV too)
  against the bf16 reference: how far a legitimate change of numerics moves them.
Prints a markdown table and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from pathlib import Path

import torch

from inference import LLM, SamplingParams, kv_quant
from inference.attention.metadata import AttentionMetadata
from prompts import PromptBuilder

ROOT = Path(__file__).parent.parent
RESULTS = Path(__file__).parent / "results"

MANUALS: dict[str, tuple[str, list[str]]] = {
    "tarx (bundled)": (
        (ROOT / "app" / "samples" / "tarx-manual.md").read_text(),
        [
            "Which option compresses the archive?",
            "How do I keep existing files?",
            "What does -v do?",
            "How do I list the contents of an archive?",
            "How do I extract into another directory?",
            "Which option creates an archive?",
        ],
    ),
    "pump (tests)": (
        (
            "The AquaPro 3 pump runs in three modes: eco, normal and boost. To reset the pump, "
            "hold the power button for ten seconds until the light blinks twice. Error E7 "
            "means the filter is blocked; clean the filter every two weeks. Boost mode runs "
            "continuously and must not be used for more than one hour. The pump must never run "
            "dry. After a long run, switch it off and let it cool for one hour. "
        )
        * 6,
        [
            "How do I reset the pump?",
            "What does error E7 mean?",
            "How often is the filter cleaned?",
            "Which mode runs continuously?",
            "How long should the pump cool?",
        ],
    ),
    "washer (tests)": (
        (
            "The WX-200 washer has four programs. Cotton washes at 60 degrees for 95 minutes. "
            "Synthetics wash at 40 degrees for 70 minutes. Quick washes at 30 degrees for 20 "
            "minutes and suits lightly soiled loads. Wool washes cold with slow spins. To pause, "
            "press START for two seconds. Error F3 means the drain filter is blocked: unscrew "
            "the cap behind the kick plate and clean it. Error F5 means the door is not locked. "
            "Use at most 40 ml of detergent. "
        )
        * 5,
        [
            "What does error F3 mean?",
            "How long does Cotton take?",
            "How do I pause?",
            "How much detergent should I use?",
            "Which program is for wool?",
        ],
    ),
}
LONG_TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]


@torch.inference_mode()
def token_nll(llm: LLM, ids: list[int], score_from: int) -> list[float]:
    """Negative log-likelihood of ids[score_from:], each given the tokens before it, the
    sequence computed as one prompt into a pool of the engine's KV dtype (its scales)."""
    runner = llm.engine.runner
    cfg, bs = runner.model_config, runner.config.block_size
    n = len(ids)
    blocks = -(-n // bs)
    shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    caches = []
    for layer in range(cfg.num_layers):
        pair = (runner.allocate_cache(shape), runner.allocate_cache(shape))
        if runner.kv_scales is not None:
            sc = runner.kv_scales
            kv_quant.attach(pair[0], sc.scale[layer, 0], sc.inv[layer, 0])
            kv_quant.attach(pair[1], sc.scale[layer, 1], sc.inv[layer, 1])
        caches.append(pair)
    meta = AttentionMetadata.build([list(range(blocks))], [n], [n], bs)
    rows = torch.arange(score_from - 1, n - 1)
    logits = runner.model.forward(
        torch.tensor(ids), torch.arange(n), meta, caches, rows
    )  # [rows, vocab] float32
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(ids[score_from:])
    return (-logp.gather(1, target[:, None])[:, 0]).tolist()


def greedy(llm: LLM, ids: list[int], max_tokens: int) -> list[int]:
    out = llm.generate(
        prompt_token_ids=[ids],
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        use_cache=False,
    )[0]
    return list(out.token_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-dtypes", nargs="+", default=["int8", "fp8"])
    ap.add_argument(
        "--no-yardstick",
        dest="yardstick",
        action="store_false",
        help="skip the float32 row (how far another numerics moves the same measures)",
    )
    ap.add_argument("--long-tokens", type=int, default=2000, help="tokens of each long text")
    args = ap.parse_args()

    base = LLM(None, dtype="bfloat16", kv_cache_gib=0.5)
    tok = base.tokenizer
    builder = PromptBuilder(tok)
    texts = {name: tok.encode(text) for name, (text, _) in MANUALS.items()}
    for path in LONG_TEXTS:
        if Path(path).exists():
            texts[Path(path).name] = tok.encode(Path(path).read_text())[: args.long_tokens]
    prompts = [
        (name, builder.build(text, q, max_model_len=8192, max_tokens=args.max_tokens).token_ids)
        for name, (text, qs) in MANUALS.items()
        for q in qs
    ]
    # the 16-bit reference: its text NLL, its greedy answers and their NLL
    ref_answers = [greedy(base, ids, args.max_tokens) for _, ids in prompts]
    results: dict[str, dict] = {}

    def measure(llm: LLM, label: str) -> None:
        text_nll = {name: token_nll(llm, ids, 1) for name, ids in texts.items()}
        ans_nll = [
            token_nll(llm, ids + ans, len(ids))
            for (_, ids), ans in zip(prompts, ref_answers, strict=True)
            if ans
        ]
        answers = (
            ref_answers
            if llm is base
            else [greedy(llm, ids, args.max_tokens) for _, ids in prompts]
        )
        results[label] = {
            "text_nll": {k: sum(v) / len(v) for k, v in text_nll.items()},
            "text_tokens": {k: len(v) for k, v in text_nll.items()},
            "answer_nll": sum(map(sum, ans_nll)) / sum(map(len, ans_nll)),
            "answer_tokens": sum(map(len, ans_nll)),
            "exact": sum(a == r for a, r in zip(answers, ref_answers, strict=True)),
            "prefix_tokens": sum(
                common_prefix(a, r) for a, r in zip(answers, ref_answers, strict=True)
            ),
            "ref_tokens": sum(map(len, ref_answers)),
            "questions": len(prompts),
            "bytes_per_token": llm.engine.kv_spec.bytes_per_token,
            "pool_tokens": llm.engine.kv_spec.num_tokens,
        }

    measure(base, "bfloat16")
    if args.yardstick:  # another legitimate numerics: float32 compute and KV
        llm = LLM(None, dtype="float32", kv_cache_gib=0.5)
        measure(llm, "float32 (yardstick)")
        llm.engine.close()
    for kv in args.kv_dtypes:
        llm = LLM(None, dtype="bfloat16", kv_dtype=kv, kv_cache_gib=0.5)
        measure(llm, kv)
        llm.engine.close()

    ref = results["bfloat16"]
    lines = [
        "| KV dtype | bytes/token | pool tokens (0.5 GiB) | "
        + " | ".join(f"ppl ratio {k}" for k in texts)
        + " | ppl ratio, answers | same answer | tokens before first difference |",
        "|---" * (6 + len(texts)) + "|",
    ]
    for label, r in results.items():
        ratios = [
            f"{torch.tensor(r['text_nll'][k] - ref['text_nll'][k]).exp().item():.4f}" for k in texts
        ]
        ans = torch.tensor(r["answer_nll"] - ref["answer_nll"]).exp().item()
        lines.append(
            f"| {label} | {r['bytes_per_token']:,} | {r['pool_tokens']:,} | "
            + " | ".join(ratios)
            + f" | {ans:.4f} | {r['exact']}/{r['questions']} | "
            f"{r['prefix_tokens']}/{r['ref_tokens']} ({r['prefix_tokens'] / r['ref_tokens']:.1%}) |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = dt.date.today().isoformat()
    out = RESULTS / f"kv-quality-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "text_tokens": {k: len(v) for k, v in texts.items()},
                "results": results,
                "table": table,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
