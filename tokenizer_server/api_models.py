"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Strict mode: "5" is not an integer and 1 is not a boolean; a wrong type is a 400
naming the field, never a silent coercion. Fields the engine cannot honour are
refused rather than ignored. Limits that depend on the model (context length,
vocabulary) are checked later, in serving.py, where the model is known.
"""

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 2**20  # the engine offsets seeds per sample


def _refuse_if_set(value, what: str = "this field is"):
    """Fields the engine cannot honour are refused, not silently ignored."""
    if value:
        raise ValueError(f"{what} not supported by this server")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + extras)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, lt=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    # extras beside the OpenAI fields
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256)
    ignore_eos: bool = False
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _unsupported_bias(cls, v):
        return _refuse_if_set(v)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingRequest):
    prompt: Any
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    # beam search (an extra, as vLLM had it): the n best of beam_width beams
    use_beam_search: bool = False
    beam_width: Optional[int] = Field(None, ge=2, le=MAX_N)
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        ok = (
            isinstance(v, str)
            or (isinstance(v, list) and v and all(isinstance(p, str) for p in v))
            or (isinstance(v, list) and v and all(_is_token(t) for t in v))
            or (
                isinstance(v, list)
                and v
                and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in v)
            )
        )
        if not ok:
            raise ValueError(
                "must be a string, a non-empty list of strings, a non-empty list of token ids (int >= 0) "
                "or a list of non-empty lists of token ids"
            )
        return v

    @field_validator("suffix")
    @classmethod
    def _unsupported_suffix(cls, v):
        return _refuse_if_set(v)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Optional[list[Any]] = None

    @field_validator("tools")
    @classmethod
    def _unsupported_tools(cls, v):
        return _refuse_if_set(v, "tool calls are")
