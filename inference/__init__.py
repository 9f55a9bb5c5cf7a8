"""docqa's inference engine: a Llama-family model on a paged, prefix-cached KV pool."""

from inference.engine import EngineConfig, LLMEngine
from inference.errors import DocqaError, ModelError, PromptTooLongError
from inference.llm import LLM, RequestOutput
from inference.sampling import SamplingParams

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
