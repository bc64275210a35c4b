"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests refuse unknown fields at every depth (a typo is a 400 naming its path and the
fields accepted there, not a silent default) and are strict about types (`"max_tokens":
"16"` or `true` is refused). Fields the API defines but the engine cannot honour yet are
accepted by the schema and refused by `unsupported_fields` with a 400 naming them, so
nothing is ever silently ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    FailFast,
    Field,
    SerializeAsAny,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

T = TypeVar("T")


class _FailFast(FailFast):
    __hash__ = object.__hash__  # pydantic's is unhashable, and unions hash their members


# A list stops at its first bad item: pydantic otherwise reports every one, and FastAPI
# turning them into its error list holds the event loop (3 million bad token ids: 46 s).
Items = Annotated[list[T], _FailFast()]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        """An unknown field is named with the fields accepted in its place (extra="forbid"
        alone names only the field)."""
        if isinstance(data, dict):
            accepted = [f.alias or name for name, f in cls.model_fields.items()]
            unknown = next((key for key in data if key not in accepted), None)
            if unknown is not None:
                raise PydanticCustomError("unknown_field", "unknown field {field}",
                                          {"field": str(unknown),
                                           "accepted": ", ".join(accepted)})
        return data


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(Request):
    """response_format.json_schema. OpenAI requires `name`; nothing here reads it."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(Request):
    """vLLM's structured_outputs (its other fields tune vLLM's own backends)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Items[str] | None = None
    grammar: str | None = None


class SamplingFields(Request):
    """What completions and chat share: sampling, stopping, streaming."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Items[str] | None = None
    stop_token_ids: Items[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's own servers log it
    # Fields routers add (vllm-router and SGLang's gateway send SGLang's request fields):
    # accepted at the value that means what hybridkv does, refused with a 400 otherwise
    # (ROUTER_FIELDS). `rid` (a request id) is accepted whatever it is.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    include_reasoning: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_hidden_states: bool = False
    continue_final_message: bool = False
    min_tokens: int = 0
    lora_path: Any = None
    session_params: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    rid: str | Items[str] | None = None
    # Structured output (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs; vLLM's old guided_* names are refused with a 400 naming the new.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _first_bad_bias(cls, value: Any) -> Any:
        """Stop at the first bad bias: pydantic reports every bad entry of a dict (FailFast
        is for lists), and a million of them hold the event loop for seconds."""
        if isinstance(value, dict):
            for token, bias in value.items():
                if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                    raise PydanticCustomError(
                        "bias_type", "logit_bias[{token}] must be a number, got {kind}",
                        {"token": str(token)[:40], "kind": type(bias).__name__})
        return value


MAX_PROMPTS = 1024  # prompts in one completion request (each is an engine request)
PROMPT_FORMS = ("a string, a list of strings, a list of token ids or a list of lists of token "
                "ids")


def _prompt_form(value: Any) -> str | None:
    """Which form a prompt takes, from its first item: only that member of the union is
    tried (trying each costs seconds on a list of millions, and buries the error that
    matters among the others)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "texts" if isinstance(first, str) else "token_lists" if isinstance(first, list) \
        else "tokens"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[Items[str], Field(max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[Items[int], Tag("tokens")]
    | Annotated[Items[Items[int]], Field(max_length=MAX_PROMPTS), Tag("token_lists")],
    Discriminator(_prompt_form, custom_error_type="prompt_form",
                  custom_error_message=f"the prompt must be {PROMPT_FORMS}")]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Request):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Another kind of part (image_url, input_audio, file) is named as such, before its
        fields would be refused as unknown ones."""
        if isinstance(data, dict) and isinstance(data.get("type"), str) and \
                data["type"] != "text":
            raise PydanticCustomError("part_type", "content parts of type {kind} are not "
                                      "supported; accepted: text",
                                      {"kind": repr(data["type"])[:60]})
        return data


class CalledFunction(Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it (or an object)


class MessageToolCall(Request):
    """An assistant's earlier call, as OpenAI's responses give it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[TextPart] | None = None
    name: str | None = None
    tool_calls: Items[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    # OpenAI's "follow the schema exactly": constrained calls (tool_choice required or
    # named) always do; an auto call is parsed, not constrained, either way.
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Items[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of the next one
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: Items[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: Items[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: Items[int]


# Router-added field -> (the value that changes nothing, what any other value would ask for).
ROUTER_FIELDS: dict[str, tuple[object, str]] = {
    "skip_special_tokens": (True, "special tokens in the output text"),
    "spaces_between_special_tokens": (True, "no spaces between special tokens"),
    "no_stop_trim": (False, "stop strings kept in the output"),
    "include_reasoning": (True, "reasoning left out of the reply"),
    "separate_reasoning": (True, "reasoning merged into the content"),
    "stream_reasoning": (True, "reasoning held back until the reply ends"),
    "return_hidden_states": (False, "hidden states"),
    "continue_final_message": (False, "continuing the final message"),
    "min_tokens": (0, "a minimum number of tokens"),
    "lora_path": (None, "a LoRA adapter"),
    "session_params": (None, "session parameters"),
    "bootstrap_host": (None, "prefill/decode disaggregation"),
    "bootstrap_port": (None, "prefill/decode disaggregation"),
    "bootstrap_room": (None, "prefill/decode disaggregation"),
}


def unsupported_fields(body: SamplingFields) -> list[tuple[str, str]]:
    """(field, why) for every field set to a value the engine cannot honour yet."""
    found = [(name, why) for name, (neutral, why) in ROUTER_FIELDS.items()
             if getattr(body, name) != neutral]
    if isinstance(body, CompletionRequest):
        if body.echo and body.logprobs is not None:
            found.append(("echo", "echo with logprobs (the prompt's logprobs)"))
        if body.best_of not in (None, 1):
            found.append(("best_of", "best_of other than 1"))
        if body.suffix is not None:
            found.append(("suffix", "suffix"))
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        found.append(("stream_options", "stream_options.continuous_usage_stats"))
    return found


# ------------------------------------------------------------------------ responses

class PromptTokensDetails(Response):
    cached_tokens: int = 0


class Usage(Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    def add(self, prompt: int, completion: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.total_tokens += prompt + completion
        self.prompt_tokens_details.cached_tokens += cached


class CompletionLogprobs(Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ThinkingMessage(AssistantMessage):
    """The reply of a model that thinks (a reasoning parser): its reasoning apart, under
    vLLM's name and under the newer one."""

    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(Response):
    index: int
    message: SerializeAsAny[AssistantMessage]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # Streamed calls: [{"index", "id", "type", "function": {"name", "arguments"}}]
    tool_calls: list[dict[str, Any]] | None = None


class ThinkingDelta(Delta):
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(Response):
    index: int
    delta: SerializeAsAny[Delta]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hybridkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Response):
    prompt: str


class ErrorInfo(Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(Response):
    error: ErrorInfo


def refuse_unknown_types(items: list[Any], accepted: tuple[str, ...], noun: str) -> None:
    """An item of a `type` outside `accepted` (an image, a document, ...) is named as such,
    in one line: "content <noun> of type 'image' are not supported; accepted: text"."""
    for item in items:
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in accepted:
            raise PydanticCustomError(
                "part_type", "content {noun} of type {kind} are not supported; accepted: "
                "{accepted}", {"noun": noun, "kind": repr(kind)[:60],
                               "accepted": ", ".join(accepted)})
