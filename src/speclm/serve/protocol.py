"""The OpenAI wire format: request validation, response bodies and error bodies.

Requests are validated strictly (a string where a number belongs is an error, not a guess) and
every user mistake becomes an OpenAI-style error body with a 4xx status. Parameters speclm does
not implement are rejected when set to anything but their no-op value, rather than ignored;
fields speclm does not know are ignored, as OpenAI clients send new ones over time.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..sampling import SamplingParams
from ..stats import RequestStats

MAX_STOP_STRINGS = 4
MAX_MESSAGES = 2048  # checked before validation: a huge list of tiny messages costs CPU, not bytes


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's name, schema and strict (always enforced here)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is 'json_schema'")
        return self


class StructuredOutputs(BaseModel):
    """speclm's extension for constraints OpenAI's format has no name for: a regex or a grammar
    (Lark-style or GBNF), exactly one."""

    model_config = ConfigDict(extra="forbid", strict=True)
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.regex is None) == (self.grammar is None):
            raise ValueError("give exactly one of regex and grammar")
        return self


class _Request(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: OpenAI's default, 1
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (as in vLLM): top-k filtering, and generating past EOS (for benchmarks)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension: a regex or a grammar

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value not in (None, 1):
            raise ValueError("only 1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _no_op_only(cls, value):
        if value not in (None, 0, 0.0, {}):
            raise ValueError("only 0 or absent is supported")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=top_p,
                              max_tokens=max_tokens, stop=list(self.stop or []), seed=self.seed,
                              ignore_eos=self.ignore_eos, **self.constraint())

    def constraint(self) -> dict[str, Any]:
        """The structured-output fields of SamplingParams this request asks for."""
        fmt, extra = self.response_format, self.structured_outputs
        out: dict[str, Any] = {}
        if fmt is not None and fmt.type == "json_object":
            out["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            out["json_schema"] = fmt.json_schema.schema_
        if extra is not None:
            out.update({"regex": extra.regex} if extra.regex is not None else {"grammar": extra.grammar})
        return out

    @property
    def constraint_param(self) -> str:
        """The request field a bad constraint is reported under."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo", "logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value not in (None, False, "") and not (info.field_name == "best_of" and value == 1):
            raise ValueError("not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (batch them as separate requests)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value):
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported (text only)")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = Field(None, union_mode="left_to_right")

    @model_validator(mode="after")
    def _content_required(self):
        # only an assistant turn may have no content (OpenAI: one that made tool calls)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    @field_validator("logprobs", "top_logprobs", "tools")
    @classmethod
    def _unsupported(cls, value):
        if value not in (None, False, 0, []):
            raise ValueError("not supported")
        return value

    def chat_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(raw: bytes, kind: type[_Request], max_context: int | None = None) -> _Request:
    """Bytes of a request body -> a validated request, or an :class:`APIError` (400).

    The sizes that make validation slow (messages, content parts, prompt token ids) are checked
    on the parsed JSON first: a few MB of tiny items cost seconds to validate, not bytes."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = sum(len(m["content"]) for m in messages
                    if isinstance(m, dict) and isinstance(m.get("content"), list))
        if len(messages) > MAX_MESSAGES or parts > MAX_MESSAGES:
            raise APIError(400, f"messages: at most {MAX_MESSAGES} messages and {MAX_MESSAGES} "
                           f"content parts per request ({len(messages)} and {parts} sent)",
                           param="messages")
    prompt = data.get("prompt")
    if max_context is not None and isinstance(prompt, list) and len(prompt) >= max_context:
        raise APIError(400, f"this model's context is {max_context} tokens; the prompt has "
                       f"{len(prompt)}", param="prompt", code="context_length_exceeded")
    try:  # JSON escapes can spell lone surrogates ("\ud800"), which no tokenizer can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request contains a string that is not valid Unicode (a lone "
                       "surrogate escape such as \\ud800)") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        # our own checks say more than a union's "not a string" for the branch that lost
        first = min(exc.errors(), key=lambda e: e["type"] != "value_error")
        param = ".".join(str(p) for p in first["loc"] if not _is_union_branch(p)) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _is_union_branch(part: object) -> bool:
    """pydantic names the union member in an error's location ("str", "list[int]")."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


# -- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(stats: RequestStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def speculation(stats: RequestStats) -> dict:
    """The per-response extension field: what speculation did for this request."""
    choice = (stats.drafter_report or {}).get("choice")
    return {"drafter": stats.drafter, **({"drafter_choice": choice} if choice else {}),
            "backend": stats.backend, "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens, "target_forwards": stats.target_forwards,
            "alpha": round(stats.alpha, 4), "tau": round(stats.tau, 4),
            "acceptance_by_position": [round(r, 4) for r in stats.acceptance_by_position],
            **({"forced_tokens": stats.forced_tokens, "forced_accepted": stats.forced_accepted,
                "grammar_rejected_tokens": stats.grammar_rejected_tokens} if stats.constrained else {})}


def completion_body(kind: str, rid: str, model: str, text: str, finish: str, stats: RequestStats) -> dict:
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(stats), "speclm": speculation(stats)}


def chunk_body(kind: str, rid: str, model: str, text: str | None, finish: str | None,
               *, first: bool = False, usage_field: bool = False) -> dict:
    """One streamed event; ``text=None`` sends an empty delta (the finishing chunk).
    ``usage_field``: the client asked for usage, so this chunk says ``"usage": null`` (the
    usage chunk after the last one carries the numbers)."""
    created = int(time.time())
    if kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if usage_field:
        body["usage"] = None
    return body


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
