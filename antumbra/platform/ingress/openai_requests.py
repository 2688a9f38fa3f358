"""OpenAI-compatible request bodies at the REST edge (pydantic; nothing below the ingress uses them).

Requests ignore fields they do not know (clients send many OpenAI options; a `cache_salt` or any
other client-chosen cache key is dropped here and can never reach the cache namespace). Fields we
know but cannot honour (`echo`, `best_of > 1`, `suffix`) validate only at their neutral values,
so the schema says so and a client relying on them gets a 400 rather than silently different
results. Numbers are strict and in OpenAI's ranges: `"16"` or `true` where a number belongs, a
`temperature` of 1e9 or an `n` of 1000 are 400s naming the parameter, never coerced.

`parse_request` turns a decoded JSON body into a request model or an `ApiError` (400) that names
the offending parameter, so FastAPI never answers with its own 422.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from antumbra.platform.ingress.chat_fields import ChatToolFields, ToolCallMessagePart, check_call_arguments
from antumbra.platform.ingress.openai_errors import ApiError, invalid

MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
MAX_CHOICES = 128  # OpenAI's bound on `n`
MAX_TEMPERATURE = 2.0  # OpenAI's range for `temperature`: [0, 2]
PENALTY_LIMIT = 2.0  # OpenAI's range for presence / frequency penalties: [-2, 2]
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit bias: [-100, 100]
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
_TEXT_PART_TYPES = ("text", "input_text")
# A prompt of token ids checked in one compiled pass for its types and one C-level `min` for its sign:
# a long prompt's element-wise checks in Python, or the field's constrained union (a per-item bound
# check, three times the plain pass), would hold the ingress's event loop, and the streams it serves,
# for milliseconds.
_TOKEN_IDS: TypeAdapter[list[int]] = TypeAdapter(list[Annotated[int, Strict()]])


def _valid_token_ids(value: list[Any]) -> bool:
    try:
        _TOKEN_IDS.validate_python(value)
    except ValidationError:
        return False
    return min(value) >= 0


def _check_text(value: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they are not text and would fail in the tokenizer.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it contains a lone surrogate)") from None
    return value


def _check_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: token ids as integer strings, biases in [-100, 100]. The vocabulary
    check needs the model, so it happens when the sampling parameters are built."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to biases")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise ValueError(f"keys must be token ids as integer strings, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ValueError(f"values must be numbers, got {bias!r} for token {key}")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            limit = f"{LOGIT_BIAS_LIMIT:g}"
            raise ValueError(f"values must be in [-{limit}, {limit}], got {bias!r} for token {key}")
        out[int(key)] = float(bias)
    return out


def _normalise_stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or a list of strings")
    if len(items) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported, got {len(items)}")
    for s in items:
        if not s:
            raise ValueError("stop sequences must not be empty")
        _check_text(s)
    return items


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema for structured outputs."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema; the JSON key is still "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _GenerationRequest(BaseModel):
    """Parameters both endpoints share; ranges are those the engine's `SamplingParams` accepts."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Strict(), Field(ge=-1)] | None = None
    min_p: Annotated[float, Strict(), Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Strict(), Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Strict(), Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    frequency_penalty: Annotated[float, Strict(), Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    repetition_penalty: Annotated[float, Strict(), Field(gt=0)] | None = None  # vLLM's extension
    logit_bias: dict[int, float] | None = None
    # vLLM extensions that load tests use to pin output lengths.
    ignore_eos: bool = False
    min_tokens: Annotated[int, Strict(), Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = None
    # Antumbra's extension for RL rollouts (R3): the experts every MoE layer chose for each token,
    # answered in the response's `antumbra` object (see openai_responses.antumbra_extension).
    return_routed_experts: bool = False
    # Structured output (`platform/ingress/structured.py` turns it into a grammar).
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        return _check_logit_bias(value)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return _normalise_stop(value)

    def check_combination(self) -> None:
        """Checks that involve several fields, after validation (an `ApiError` naming the parameter)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise invalid("response_format of type json_schema needs a json_schema object",
                          "response_format.json_schema")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`. One prompt: a string, a list of token ids, or a one-element batch."""

    # Left to right: the first form that fits is taken, so a long prompt of token ids is validated once
    # (the smart mode tries every form on it).
    prompt: Annotated[
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1, max_length=1),
        ],
        Field(union_mode="left_to_right"),
    ]
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Literal[False] = False
    best_of: Annotated[int, Strict(), Field(ge=1, le=1)] | None = None
    suffix: Annotated[str, Field(max_length=0)] | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # a batch of one
        if isinstance(value, list) and value and _valid_token_ids(value):
            return value  # the field's union would only check again what this pass checked
        return handler(cls._prompt_form(value))

    @staticmethod
    def _prompt_form(value: Any) -> str | list[int]:
        """A prompt that is not a plain list of token ids: the text checked, else what is wrong, named."""
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return _check_text(value)
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            # What is wrong, named:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                if any(t < 0 for t in value):
                    raise ValueError("token ids must be non-negative")
                return value
            if all(isinstance(t, str | list) for t in value):
                raise ValueError("only one prompt per request is supported")
        raise ValueError("must be a string or a list of token ids")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessagePart] | None = None  # assistant
    reasoning_content: str | None = None  # assistant: its earlier reasoning (DeepSeek's name)
    reasoning: str | None = None  # the same, by vLLM's name
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        """The message's text: a string as is, text parts joined; other part types are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return _check_text(self.content)
        pieces = []
        for part in self.content:
            if part.type not in _TEXT_PART_TYPES or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported; send text")
            pieces.append(_check_text(part.text))
        return "".join(pieces)


class ChatCompletionRequest(_GenerationRequest, ChatToolFields):
    """`POST /v1/chat/completions`; tools and thinking: `chat_fields.ChatToolFields`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @property
    def output_limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) wins over the older `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat encoding takes them; `developer` is OpenAI's newer name for `system`."""
        return [_template_message(i, message) for i, message in enumerate(self.messages)]

    def check_combination(self) -> None:
        super().check_combination()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        self.check_tools()


def _template_message(i: int, message: ChatMessage) -> dict[str, Any]:
    try:
        text = message.text()
    except ValueError as exc:
        raise invalid(str(exc), f"messages[{i}].content") from None
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant":
        if message.tool_calls:
            out["tool_calls"] = check_call_arguments(message.tool_calls, f"messages[{i}].tool_calls")
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if not message.tool_call_id:
            raise invalid("a tool message needs the tool_call_id it answers", f"messages[{i}].tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    return out


def parse_request(model_cls: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a 400 `ApiError` naming the first bad parameter on failure."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        request = model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    check = getattr(request, "check_combination", None)
    if check is not None:
        check()
    return request


def validation_error(errors: Any) -> ApiError:
    """The 400 for pydantic / FastAPI validation errors: the first error, with its location as `param`."""
    errors = list(errors)
    if not errors:
        return invalid("invalid request")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = error_param(loc)
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param in _UNSUPPORTED:
        message = f"{message} ({param} is not supported by this server beyond its default)"
    return invalid(f"{param}: {message}" if param else message, param)


def error_param(loc: list[Any]) -> str | None:
    """`["messages", 0, "content"]` → `"messages[0].content"`; union-branch tags such as `str` are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break  # a union branch ("list[int]", "function-after[...]"): the path above it is the param
    return out or None


_UNSUPPORTED = {"echo", "best_of", "suffix"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)
Kind = Literal["completion", "chat"]  # which endpoint a request came in by
