"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Strict mode: "5" is not an integer and 1 is not a boolean; a wrong type is a 400 naming the
field, never a silent coercion. Every field is bounded here, before anything reaches the
tokenizer or the wire to the engine:

- ints fit msgpack's int64 (the wire), and counts have caps of their own;
- floats are finite: Python's JSON parser reads the literals NaN and Infinity, and
  allow_inf_nan=False refuses them as pydantic parses;
- strings are valid text: a JSON "\\ud800" escape decodes to a lone surrogate, which no
  tokenizer or UTF-8 encoder accepts;
- lists are capped.

Unions are discriminated by the JSON value's shape, so a bad value gets one error at one path
("prompt.1", "messages.0.content") instead of one per union member. Fields that would change
what a request means but are not implemented are refused unless they hold their "off" value;
unknown fields are ignored, as OpenAI clients send extras. Limits that depend on the model
(context length, vocabulary) are checked in serving_common.py, where the model is known.

The sampling fields' bounds come from their one definition (radixkv/sampling_params.py, via
_sampling_field); what is written here is the API's own: OpenAI's names and ranges (temperature
<= 2, n <= 128, max_completion_tokens), caps that keep a request small and on the wire's int64,
and which endpoint takes which field. Rules between fields are SamplingParams.validate's,
called in serving_common.
"""

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from radixkv.sampling_params import MAX_LOGPROBS, MAX_SEED, rule

INT64_MAX = 2**63 - 1  # msgpack's int64: the largest int the wire to the engine carries
MAX_N = 128
MAX_TOKENS = 2**31 - 1  # above any context; the model's own limit is checked in serving_common
MAX_PROMPTS = 1024
MAX_PROMPT_TOKEN_IDS = 2**20  # per token-id prompt; the model's context is checked later
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # matching holds back up to this much text per choice
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256
MAX_NAME_CHARS = 256  # user, messages.*.name, cache_salt
MAX_MODEL_NAME_CHARS = 1024
# Beams rank by cumulative_logprob / generated_len ** length_penalty, a Python float power in
# the engine: with |length_penalty| <= 10 it stays finite and non-zero for any length below
# 2**31 (2**310 < 1e94), where 1536 ** 100 already raises OverflowError. Useful values: 0.5-2.
MAX_LENGTH_PENALTY = 10.0


# ---- value types -------------------------------------------------------------------------------


def _sampling_field(name: str, default=None, *, param: str | None = None, **caps):
    """A request field that maps to SamplingParams' `param` (default: the same name): its bounds
    as SamplingParams' rule has them, narrowed by the API's caps."""
    return Field(default, **{**rule(param or name).api_bounds(), **caps})



def _valid_text(s):
    """Refuse lone surrogates: no UTF-8 form, so the tokenizer and every encoder fail on them.
    Runs before the type and length checks (which then see valid text); a non-str is theirs."""
    if not isinstance(s, str) or s.isascii():  # isascii is O(1), and ASCII cannot hold one
        return s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        message = f"invalid text: a lone surrogate (U+{ord(s[e.start]):04X}) at character {e.start}"
        raise PydanticCustomError("invalid_text", message) from None
    return s


def _non_empty_stop(s: str) -> str:
    if not s:
        raise PydanticCustomError("empty_stop", "stop strings must be non-empty")
    return s


def _shape(v) -> str | None:
    """The union tag of a JSON value: its type's name. None (no member) becomes the union's error."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list[...]"
    return None


def _prompt_shape(v) -> str | None:
    """A prompt's union tag, decided by its first element: text, texts, token ids or lists of them."""
    if isinstance(v, str):
        return "str"
    if not isinstance(v, list) or not v:
        return None
    if isinstance(v[0], str):
        return "list[str]"
    if isinstance(v[0], list):
        return "list[list[int]]"
    return "list[int]"


def _one_of(message: str, shape=_shape) -> Discriminator:
    return Discriminator(shape, custom_error_type="invalid_type", custom_error_message=message)


Text = Annotated[str, BeforeValidator(_valid_text)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), BeforeValidator(_valid_text)]
Salt = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), BeforeValidator(_valid_text)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # < vocabulary: serving_common
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS), AfterValidator(_non_empty_stop),
                       BeforeValidator(_valid_text)]
Stop = Annotated[
    Union[Annotated[StopString, Tag("str")],
          Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), Tag("list[...]")]],
    _one_of("must be a string or a list of strings"),
]
Prompt = Annotated[
    Union[
        Annotated[Text, Tag("str")],
        Annotated[list[Text], Field(max_length=MAX_PROMPTS), Tag("list[str]")],
        Annotated[TokenIds, Tag("list[int]")],
        Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS), Tag("list[list[int]]")],
    ],
    _one_of("must be a string, a non-empty list of strings, a non-empty list of token ids (int >= 0) "
            "or a non-empty list of non-empty lists of token ids", _prompt_shape),
]
EarlyStopping = Annotated[
    Union[Annotated[bool, Tag("bool")], Annotated[Literal["never"], Tag("str")]],
    _one_of('must be true, false or "never"'),
]


def _is_off(value, off) -> bool:
    # type-exact: 0 is not False and 1 is not True here
    return value is off if off is None else (type(value) is type(off) and value == off)


def _refused(*off_values, what: str = "not supported by this server"):
    """A field the server cannot honour: accepted at an "off" value (null, or as listed), else a
    400 naming it, never silently ignored. Typed Any, so any other value gets this one error."""

    def check(value):
        if not any(_is_off(value, off) for off in (None, *off_values)):
            raise PydanticCustomError("unsupported", what)
        return value

    return Annotated[Any, AfterValidator(check)]


TOOLS_REFUSED = "tool calls are not supported by this server"


# ---- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + extras)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: Annotated[str, Field(max_length=MAX_MODEL_NAME_CHARS), BeforeValidator(_valid_text)]
    n: int = _sampling_field("n", 1, le=MAX_N)
    max_tokens: Optional[int] = _sampling_field("max_tokens", le=MAX_TOKENS)
    temperature: Optional[float] = _sampling_field("temperature", le=2.0)  # OpenAI's range
    top_p: Optional[float] = _sampling_field("top_p")
    seed: Optional[int] = _sampling_field("seed")
    stop: Optional[Stop] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Name] = None
    presence_penalty: Optional[float] = _sampling_field("presence_penalty")
    frequency_penalty: Optional[float] = _sampling_field("frequency_penalty")
    logit_bias: _refused({}) = None
    response_format: _refused({"type": "text"}) = None
    # extras beside the OpenAI fields (vLLM's names)
    cache_salt: Optional[Salt] = None
    ignore_eos: bool = False
    top_k: Optional[int] = _sampling_field("top_k", le=INT64_MAX)  # -1, 0: off; >= the vocabulary: off too
    min_p: Optional[float] = _sampling_field("min_p")
    repetition_penalty: Optional[float] = _sampling_field("repetition_penalty", le=10.0)
    min_tokens: int = _sampling_field("min_tokens", 0, le=MAX_TOKENS)
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    skip_special_tokens: bool = True
    # vLLM extras that change the output and are not implemented
    guided_json: _refused() = None
    guided_regex: _refused() = None
    guided_choice: _refused() = None
    guided_grammar: _refused() = None
    structured_outputs: _refused() = None
    prompt_logprobs: _refused() = None
    include_stop_str_in_output: _refused(False) = None  # the output processor has it; the API keeps it off

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: Optional[int] = _sampling_field("logprobs")
    suffix: _refused("") = None
    best_of: Optional[int] = _sampling_field("best_of", le=MAX_N)
    # beam search (an extra, as vLLM had it): the n best of beam_width beams; the beam-only
    # fields are refused without use_beam_search (serving_common)
    use_beam_search: bool = False
    beam_width: Optional[int] = _sampling_field("beam_width", le=MAX_N)
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: EarlyStopping = False

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


Content = Annotated[
    Union[Annotated[Text, Tag("str")],
          Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS), Tag("list[...]")]],
    _one_of("must be a string or a list of content parts"),
]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Content] = None
    name: Optional[Name] = None
    tool_calls: _refused([], what=TOOLS_REFUSED) = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[int] = _sampling_field("max_completion_tokens", param="max_tokens",
                                                           le=MAX_TOKENS)  # OpenAI's newer name
    logprobs: bool = False
    top_logprobs: Optional[int] = _sampling_field("top_logprobs", param="logprobs")  # logprobs: k, with logprobs
    add_generation_prompt: bool = True
    tools: _refused([], what=TOOLS_REFUSED) = None
    tool_choice: _refused("none", what=TOOLS_REFUSED) = None
    parallel_tool_calls: _refused(what=TOOLS_REFUSED) = None
    functions: _refused([], what=TOOLS_REFUSED) = None
    function_call: _refused("none", what=TOOLS_REFUSED) = None
    audio: _refused() = None
    modalities: _refused(["text"]) = None
    prediction: _refused() = None
    web_search_options: _refused() = None
    # completions-only fields: here they would be ignored, so they are refused
    best_of: _refused(what="not supported by chat completions; use n") = None
    use_beam_search: _refused(False, what="not supported by chat completions; use /v1/completions") = None
    echo: _refused(False, what="not supported by chat completions") = None
    # vLLM's chat extras that change the prompt
    chat_template: _refused() = None
    chat_template_kwargs: _refused({}) = None
    continue_final_message: _refused(False) = None
    documents: _refused() = None
