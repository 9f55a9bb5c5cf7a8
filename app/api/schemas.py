"""Request and response bodies (msgspec structs) and the bounds of path and query parameters.
The ``max_tokens`` cap is the server's setting: the service checks it, and ``app/api/openapi.py``
writes it into the schema as each such field's maximum."""

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from litestar.params import Parameter
from msgspec import Meta, Struct

from app.answer import Ledger

MAX_TITLE_CHARS = 512
MAX_QUESTION_CHARS = 20_000
MAX_PAGE = 1000  # items a list returns at most
MAX_OFFSET = 1_000_000_000  # items a list may skip
# the ids docqa makes (man_…, conv_…, msg_…, chatcmpl-…), in paths, queries and bodies
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,100}$"

CacheMode = Literal["default", "bypass"]


# -- manuals -------------------------------------------------------------------------------------
class ManualCreate(Struct, forbid_unknown_fields=True):
    """A manual as JSON (the alternative to a multipart ``file`` upload)."""

    title: Annotated[str, Meta(min_length=1, max_length=MAX_TITLE_CHARS)]
    text: Annotated[str, Meta(min_length=1)]


class PartOut(Struct):
    index: int
    title: Annotated[str, Meta(description="the sections the part holds")]
    tokens: Annotated[int, Meta(description="tokens of the part's text, its header line included")]
    start_char: Annotated[
        int, Meta(description="where the part starts in the manual's text (its overlap included)")
    ] = 0
    end_char: Annotated[int, Meta(description="where it ends (exclusive)")] = 0


class PartRanked(Struct):
    index: int
    title: str
    score: Annotated[float, Meta(description="full-text search rank (BM25; higher first)")]


class PartSearchOut(Struct):
    manual_id: str
    question: str
    parts: Annotated[
        list[PartRanked],
        Meta(description="the parts holding any word of the question, best first"),
    ]
    chosen: Annotated[int, Meta(description="the part a question without history would use")]


class ManualOut(Struct):
    id: str
    title: str
    tokens: Annotated[int, Meta(description="tokens of the manual's text")]
    sha256: Annotated[str, Meta(description="sha256 of the manual's extracted text")]
    source_type: str
    created_at: datetime
    ledger: Annotated[
        Ledger,
        Meta(
            description="what the cache saved answering about this manual: answers, their "
            "prompt tokens, of those the ones reused from the cache (by tier), and the TTFT "
            "the cache saved them in total (each answer's ttft_saved_ms)"
        ),
    ]
    parts: Annotated[
        list[PartOut],
        Meta(
            description="the prompt prefixes the manual is answered from: one, the whole "
            "manual, when it fits the model's window; else its parts, each question answered "
            "from the one full-text search ranks first"
        ),
    ] = msgspec.field(default_factory=list)


class ManualDetail(ManualOut):
    text: str = ""


class ManualList(Struct):
    items: list[ManualOut]


class PinOut(Struct):
    manual_id: str
    pinned: bool
    pinned_tokens: Annotated[int, Meta(description="tokens of the manual's prefix held")]
    pinned_blocks_total: Annotated[int, Meta(description="blocks pinned in the engine")]
    pin_budget_blocks: int


class CancelOut(Struct):
    id: str
    cancelled: bool
    finish_reason: str
    completion_tokens: int


class WarmOut(Struct):
    manual_id: str
    prompt_tokens: Annotated[int, Meta(description="system instructions + manual")]
    cached_tokens: Annotated[int, Meta(description="of those, tokens now in the cache")]
    computed_tokens: Annotated[int, Meta(description="tokens computed by this call")]
    elapsed_ms: float
    redis: Annotated[str, Meta(description="Redis tier: disabled, ok or degraded")] = "disabled"
    redis_cached_tokens: Annotated[
        int, Meta(description="of prompt_tokens, those Redis holds once this call returns")
    ] = 0
    parts: Annotated[int, Meta(description="prefixes warmed: the manual's parts")] = 1


# -- conversations -------------------------------------------------------------------------------
BodyId = Annotated[str, Meta(pattern=ID_PATTERN, description="an id docqa returned")]


class ConversationCreate(Struct, forbid_unknown_fields=True):
    manual_id: BodyId


class MessageOut(Struct):
    id: str
    role: str
    content: str
    created_at: datetime
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, float | str] | None = None
    warnings: list[str] = msgspec.field(default_factory=list)
    part: Annotated[int | None, Meta(description="the manual's part that answered")] = None


class ConversationOut(Struct):
    id: str
    manual_id: str
    created_at: datetime
    message_count: int = 0


class ConversationDetail(ConversationOut):
    messages: list[MessageOut] = msgspec.field(default_factory=list)


class ConversationList(Struct):
    items: list[ConversationOut]


# -- engine ----------------------------------------------------------------------------------------
class EngineInfo(Struct):
    model: str
    model_family: Annotated[str, Meta(description="llama, mistral, qwen2 or qwen3")]
    quantization: Annotated[
        str,
        Meta(
            description="the imported GGUF's quantization (Q4_K_M, Q8_0, ...), or the "
            "checkpoint's dtype"
        ),
    ]
    weights: Annotated[
        str,
        Meta(
            description="files (the model's own), or random (a benchmark model, random:NAME: "
            "its answers are noise)"
        ),
    ]
    dtype: str
    kv_dtype: str
    device: str
    attention_backend: Annotated[
        str, Meta(description="torch, cpu (compiled CPU attention kernels) or triton")
    ]
    linear_weight_bytes: Annotated[
        dict[str, int],
        Meta(
            description="bytes of the linear layers' weights by how they are held: q4_1 and "
            "q8_0 (a GGUF model's blocks kept as such in float32, expanded exactly as each "
            "product runs), float32 or bfloat16"
        ),
    ]
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    kv_capacity_blocks: int
    max_concurrency: Annotated[
        float, Meta(description="sequences of max_model_len tokens the KV pool holds at once")
    ]
    max_batched_tokens: Annotated[
        int, Meta(description="tokens an engine step carries, decodes and prompt chunks")
    ]
    prefill_tokens_with_decodes: Annotated[
        int,
        Meta(description="prompt tokens a step carries while answers are decoding (0: no limit)"),
    ]
    blocks_in_use: int
    blocks_cached: int
    blocks_free: int
    requests_running: int
    requests_waiting: int
    prompt_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefix_cache_copied_tokens_total: int  # of those, copied into the request's own block
    prompt_tokens_computed_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    requests_cancelled_total: int
    deferred_admissions_total: int
    pinned_blocks: int
    pin_budget_blocks: int
    prefix_cache_hit_rate: float


# -- OpenAI-compatible ---------------------------------------------------------------------------
class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class ModelCard(Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "docqa"
    family: str | None = None  # llama, mistral, qwen2 or qwen3
    quantization: str | None = None  # the GGUF's quantization, or the checkpoint's dtype
    max_model_len: int | None = None  # tokens a prompt and its answer may hold


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


# -- parameters ------------------------------------------------------------------------------------
def path_id(what: str) -> Parameter:
    return Parameter(pattern=ID_PATTERN, description=f"the id of a {what}")


PageLimit = Annotated[int, Parameter(ge=1, le=MAX_PAGE, description="items to return")]
PageOffset = Annotated[int, Parameter(ge=0, le=MAX_OFFSET, description="items to skip first")]
ManualId = Annotated[str, path_id("manual")]
QuestionQuery = Annotated[
    str,
    Parameter(
        min_length=1, max_length=MAX_QUESTION_CHARS, description="the question to rank parts for"
    ),
]
ConversationId = Annotated[str, path_id("conversation")]
RequestId = Annotated[str, path_id("running answer (the answer object's id)")]


# -- questions -------------------------------------------------------------------------------------
MaxTokens = Annotated[
    int, Meta(ge=1, description="answer length in tokens, at most the server's cap", examples=[8])
]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Question = Annotated[
    str, Meta(min_length=1, max_length=MAX_QUESTION_CHARS, examples=["What does -k do?"])
]


PartIndex = Annotated[
    int,
    Meta(
        ge=0,
        description="a manual stored as parts: answer from this part (0-based), not the one "
        "full-text search ranks first",
    ),
]


class AnswerOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    stream: bool = False
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    seed: int | None = None
    cache: CacheMode = "default"
    ignore_eos: bool = False
    # false: no prompt-lookup drafts for this answer (it is the same either way; only its
    # speed differs)
    speculate: bool = True
    part: PartIndex | None = None


class MessageCreate(AnswerOptions, kw_only=True):
    content: Question


class AskCreate(AnswerOptions, kw_only=True):
    manual_id: BodyId
    question: Question


class ManualAskCreate(AnswerOptions, kw_only=True):
    """A question about the manual the path names."""

    question: Question


class ChatCompletionCreate(Struct):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: int | None = None
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    manual_id: BodyId | None = None
    cache: CacheMode = "default"
    ignore_eos: bool = False
    speculate: bool = True
    part: PartIndex | None = None
