"""docqa's inference engine: a Llama-family model on a paged, prefix-cached KV pool."""

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.errors import DocqaError, ModelError, PromptTooLongError
from inference.llm import LLM, RequestOutput

__all__ = [
    "LLM",
    "DocqaError",
    "EngineConfig",
    "LLMEngine",
    "ModelError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
]
