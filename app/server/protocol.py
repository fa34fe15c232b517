"""Pydantic models of the requests and responses the server speaks (OpenAI and Ollama).

Requests are validated strictly (a string is not a number, a float is not an integer) and
unknown fields are ignored, as OpenAI-compatible servers do; checks that need the model
(token ids, the context window) happen later.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- OpenAI requests -------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's thinking (vLLM, DeepSeek)


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    """OpenAI's response_format, plus {"type": "grammar", "grammar": "<GBNF or Lark>"}."""

    type: Literal["text", "json_object", "json_schema", "grammar"]
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    def as_format(self) -> dict[str, Any]:
        """The engine's response_format for this object."""
        return self.model_dump(exclude_none=True)


class SamplingParams(_Request):
    """Sampling fields shared by chat and text completions (with our extensions)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None
    # ours: let a conversation that outgrows the context window drop its oldest turns
    # (`truncation` as OpenAI's Responses API names it); unset, it is refused with the counts
    truncate: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None


class ChatCompletionRequest(SamplingParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # A reasoning model's thinking switch: vLLM's {"enable_thinking": false}, or `think`.
    chat_template_kwargs: dict[str, Any] | None = None
    think: bool | None = None


class CompletionRequest(SamplingParams):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Request):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str
    tokens: list[int]


# -- OpenAI responses ------------------------------------------------------------------------
class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # the thinking of a reasoning model (left out: none)


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(_Response):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "localchat"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- Ollama requests ---------------------------------------------------------------------------
class OllamaOptions(BaseModel):
    """Ollama's `options`; the ones with no meaning here are accepted and ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    num_predict: int | None = None
    num_ctx: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    truncate: bool | None = None  # ours, as the top-level `truncate`


class OllamaMessage(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls: [{"function": {name, arguments}}]
    tool_name: str | None = None  # a tool result's function
    thinking: str | None = None  # an assistant's earlier thinking


class OllamaBase(_Request):
    model: str = Field(min_length=1)
    stream: bool | None = None
    options: OllamaOptions | None = None
    format: Any = None
    keep_alive: float | str | None = None
    truncate: bool | None = None  # drop the oldest turns when the prompt outgrows the window
    think: bool | None = None  # a reasoning model's thinking switch (None: its default)


class OllamaChatRequest(OllamaBase):
    messages: list[OllamaMessage] | None = None
    tools: list[Any] | None = None


class OllamaGenerateRequest(OllamaBase):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class OllamaModelRequest(_Request):
    model: str | None = None
    name: str | None = None  # older clients

    @property
    def ref(self) -> str | None:
        return self.model or self.name


class OllamaCopyRequest(_Request):
    source: str | None = None
    destination: str | None = None


class OllamaPullRequest(OllamaModelRequest):
    stream: bool | None = None
    insecure: bool | None = None
