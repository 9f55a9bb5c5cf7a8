"""The offline Python API, in vLLM's shape: ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.errors import ModelError
from inference.metrics import RequestMetrics
from inference.model import bench_model
from inference.model.model_import import DEFAULT_MODEL_NAME, import_default_model, models_dir


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids, end-of-turn token included when it stopped there
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    finish_reason: str  # "stop" | "length" | "abort" (a failed request raises its error)
    metrics: RequestMetrics
    accepted_prediction_tokens: int = 0  # drafted tokens that became the answer's
    rejected_prediction_tokens: int = 0  # drafted tokens verified and discarded


def resolve_model(model: str | Path | None) -> Path:
    """None: the default model (imported on first use); a name under $DOCQA_HOME/models;
    a path to a Hugging Face layout directory; or ``random:NAME``, a benchmark model
    (``inference/model/bench_model.py``: its weights drawn by the engine)."""
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return import_default_model()
    if bench_model.is_benchmark_model(model):
        return bench_model.benchmark_model_dir(model)
    p = Path(model).expanduser()
    if (p / "config.json").is_file():
        return p
    named = models_dir() / str(model)
    if (named / "config.json").is_file():
        return named
    raise ModelError(
        f"unknown model {str(model)!r}: not a directory with config.json, nor a model under "
        f"{models_dir()}"
    )


def benchmark_seed(model: str | Path | None) -> dict:
    """The engine setting a ``random:NAME`` model needs (its weights' seed), else none."""
    return (
        {"random_weights_seed": bench_model.SEED} if bench_model.is_benchmark_model(model) else {}
    )


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", **engine_kwargs):
        engine_kwargs = {**benchmark_seed(model), **engine_kwargs}
        self.engine = LLMEngine(
            EngineConfig(model_dir=resolve_model(model), dtype=dtype, **engine_kwargs)
        )
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: list[str] | str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_cache: bool = True,
        namespace: bytes = b"",
        speculate: bool = True,
        draft_group: bytes | str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; one output per prompt, in order.

        Text prompts are encoded as plain text (no chat template, no special tokens parsed).
        ``draft_group``: with speculation on, the prompts draft from the group's earlier
        answers too (``LLMEngine.add_request``).
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids_list = prompt_token_ids or [self.tokenizer.encode(p) for p in prompts]
        params = sampling_params or SamplingParams()
        engine = self.engine
        reqs = []
        try:
            for ids in ids_list:
                reqs.append(
                    engine.add_request(
                        ids,
                        params,
                        use_cache=use_cache,
                        namespace=namespace,
                        speculate=speculate,
                        draft_group=draft_group,
                    )
                )
            while any(not r.finished for r in reqs):
                engine.step()
        except BaseException:
            for r in reqs:
                engine.abort(r.request_id)
            raise
        failed = next((r for r in reqs if r.error is not None), None)
        if failed is not None:
            for r in reqs:
                engine.release(r)
            raise failed.error
        outs = []
        for r in reqs:
            outs.append(
                RequestOutput(
                    request_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    text=self.tokenizer.decode(r.output_token_ids),
                    token_ids=list(r.output_token_ids),
                    num_cached_tokens=max(r.num_cached_tokens, 0),
                    finish_reason=r.finish_reason or "abort",
                    metrics=engine.request_metrics(r),
                    accepted_prediction_tokens=r.num_accepted_tokens,
                    rejected_prediction_tokens=r.num_rejected_tokens,
                )
            )
            engine.release(r)
        return outs
