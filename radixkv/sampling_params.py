"""SamplingParams: how one request samples, when it stops and how its text is made (vLLM's vocabulary).

This is the one definition of a request's sampling fields: their types, defaults, bounds and
rules. Everything else derives from it: the engine uses this class, the wire to the engine
worker carries a msgspec struct built from its fields (radixkv.protocol.SamplingOptions), the
HTTP front maps the OpenAI request onto it and takes its bounds from here, and `radixkv
generate` makes one flag per field. The module imports neither torch nor anything of the
engine but its ParamError, so the front loads it cheaply.

Seeds: with `seed=s`, sample i of the request draws from its own generator seeded `s + i`,
so n samples with seed s equal n single-sample requests with seeds s, s+1, ... . Without a
seed, samples draw from the engine's generator.

Beam search (`use_beam_search=True`) keeps `beam_width` beams (default: best_of, else n) and
returns the n best finished hypotheses, ranked as HF transformers' generate(num_beams=W,
do_sample=False) ranks them: cumulative logprob / generated_len ** length_penalty, with its
`early_stopping` rules (True, False or "never"). It is deterministic: it ranks the model's raw
log-probabilities, so temperature and seed do not apply, and the fields that would reshape the
distribution (top_p, top_k, min_p, penalties) must stay at their defaults.

Structured outputs (`structured_outputs=StructuredOutputs(json=schema)`, or one of json_object,
regex, choice, grammar): every sample's output is constrained to the grammar (radixkv/engine/
structured.py, through xgrammar); the sample ends with "stop" when the grammar is complete. The
shape of the spec is checked here (torch-free); the engine compiles it when the request is added.

Stop strings (`stop`) and the text fields (`skip_special_tokens`, `include_stop_str_in_output`)
are applied by the output processor (radixkv/output_processor.py) of the front and of the
offline LLM; the engine itself works on token ids and ignores them.

NOTE: every field carries its Rule in the dataclass field's metadata, and validate() checks
them in declaration order, then the rules between fields. The per-field messages read
"<field> must be <what the rule admits>, got <value>"; the messages of the rules between fields
are those the HTTP API has always given ("<field>: <why>"), so a client sees the same text
whether the front or the engine refuses. The HTTP layer adds only its own caps on top (OpenAI's
ranges, e.g. temperature <= 2, n <= 128, and what fits the wire's int64), in api_models.py.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import MISSING, dataclass, field, fields

from radixkv.engine.errors import ParamError

MAX_LOGPROBS = 20  # top-k logprobs per token the sampler returns at most
MAX_SEED = 2**63 - 2**20  # seeds are offset per sample (seed + i) and must stay below int64


@dataclass(frozen=True)
class Rule:
    """What one field admits. Numbers: kind int or float, optional bounds (floats must be finite);
    lists: kind list with `items` the rule of each element; `choices`: further admitted values."""

    kind: type
    nullable: bool = False  # None admitted (meaning: see the field's doc)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    items: "Rule | None" = None
    choices: tuple = ()
    what: str | None = None  # the admitted values in words, where the bounds alone say it badly

    def admits(self, v) -> bool:
        if v is None:
            return self.nullable
        if any(v == c and type(v) is type(c) for c in self.choices):
            return True
        if self.kind is bool:
            return isinstance(v, bool)
        if self.kind is int:
            return _is_int(v) and self._in_bounds(v)
        if self.kind is float:
            return _is_num(v) and math.isfinite(float(v)) and self._in_bounds(v)
        if self.kind is str:
            return isinstance(v, str) and self._in_bounds(len(v))
        if self.kind is list:
            return isinstance(v, (list, tuple)) and all(self.items.admits(x) for x in v)
        if self.kind is StructuredOutputs:  # its own fields: validate_structured_outputs
            return isinstance(v, StructuredOutputs)
        raise TypeError(f"no check for {self.kind}")

    def _in_bounds(self, v) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def describe(self) -> str:
        what = self.what or self._describe()
        return f"None or {what}" if self.nullable else what

    def _describe(self) -> str:
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if self.kind is bool:
            return "a bool"
        if lo is not None and hi is not None:
            interval = f"{'[' if self.ge is not None else '('}{_fmt(lo)}, {_fmt(hi)}{']' if self.le is not None else ')'}"
            return f"an int in {interval}" if self.kind is int else f"in {interval}"
        noun = "an int" if self.kind is int else "a finite number"
        if lo is not None:
            return f"{noun} {'>=' if self.ge is not None else '>'} {_fmt(lo)}"
        if hi is not None:
            return f"{noun} {'<=' if self.le is not None else '<'} {_fmt(hi)}"
        return noun

    def api_bounds(self) -> dict:
        """The bounds as pydantic's Field takes them (ge, gt, le, lt)."""
        return {k: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}


def _fmt(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    """A real number that converts to a float (an int past float's range does not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


# JSON-schema keywords xgrammar would ignore (its output would not keep them): refused up front
UNSUPPORTED_JSON_SCHEMA_KEYWORDS = ("uniqueItems", "not", "if", "then", "else", "patternProperties")
# keywords whose values are maps of names to schemas, and those whose values are data, not schemas
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_DATA = ("enum", "const", "default", "examples", "required", "title", "description", "$comment",
                "pattern", "format", "type", "$ref", "$schema", "$id")


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (vLLM's names): exactly one of a JSON schema (dict or JSON text),
    any JSON object, a regex, one of a list of strings, or an EBNF grammar (llama.cpp's GBNF form,
    rule `root`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @property
    def kind(self) -> str:
        """The one field set (after validate_structured_outputs)."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    def schema(self) -> dict:
        """The JSON schema as a dict (kind "json")."""
        return self.json if isinstance(self.json, dict) else _json.loads(self.json)


_STRUCTURED_FIELDS = frozenset(f.name for f in fields(StructuredOutputs))


def validate_structured_outputs(so: StructuredOutputs) -> None:
    """Exactly one field set, of its type; a JSON schema parses and uses no keyword xgrammar
    ignores. ParamError names the field ("structured_outputs.json")."""
    name = "structured_outputs"
    if not isinstance(so.json_object, bool):
        raise ParamError(f"{name}.json_object", f"{name}.json_object must be a bool, got {so.json_object!r}")
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    given += ["json_object"] if so.json_object else []
    if len(given) != 1:
        raise ParamError(name, f"{name}: exactly one of json, json_object, regex, choice, grammar must be set, "
                               f"got {', '.join(given) or 'none'}")
    field_name = f"{name}.{given[0]}"
    if so.json is not None:
        if not isinstance(so.json, (dict, str)):
            raise ParamError(field_name, f"{field_name} must be a JSON schema (a dict or its JSON text), "
                                         f"got {type(so.json).__name__}")
        try:
            schema = so.schema()
        except ValueError as e:
            raise ParamError(field_name, f"{field_name}: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ParamError(field_name, f"{field_name} must be a JSON object (a schema), got {schema!r}")
        found = sorted(set(_unsupported_keywords(schema)), key=UNSUPPORTED_JSON_SCHEMA_KEYWORDS.index)
        if found:
            raise ParamError(field_name, f"{field_name}: the JSON-schema keywords {', '.join(found)} are not "
                                         "supported (the grammar would not enforce them)")
    for k in ("regex", "grammar"):
        v = getattr(so, k)
        if v is not None and (not isinstance(v, str) or not v):
            raise ParamError(f"{name}.{k}", f"{name}.{k} must be a non-empty str, got {v!r}")
    if so.choice is not None:
        c = so.choice
        if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, str) and x for x in c):
            raise ParamError(field_name, f"{field_name} must be a non-empty list of non-empty strs, got {c!r}")


def _unsupported_keywords(schema):
    """The unsupported keywords used anywhere in `schema` (property names are not keywords)."""
    if isinstance(schema, list):
        for s in schema:
            yield from _unsupported_keywords(s)
        return
    if not isinstance(schema, dict):
        return
    for k, v in schema.items():
        if k in UNSUPPORTED_JSON_SCHEMA_KEYWORDS:
            yield k
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            for sub in v.values():
                yield from _unsupported_keywords(sub)
        elif k not in _SCHEMA_DATA:
            yield from _unsupported_keywords(v)


def _param(default, rule: Rule, doc: str, *, beam: bool = False):
    """A SamplingParams field: default, rule, one-line doc (also the CLI's help). beam: the field
    applies to beam search only."""
    meta = {"rule": rule, "doc": doc, "beam": beam}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SamplingParams:
    n: int = _param(1, Rule(int, ge=1), "samples returned")
    best_of: int | None = _param(None, Rule(int, nullable=True, ge=1),
                                 "samples drawn (>= n); the n with the best cumulative logprob are returned")
    temperature: float = _param(1.0, Rule(float, ge=0.0), "0 = greedy")
    top_p: float = _param(1.0, Rule(float, gt=0.0, le=1.0), "nucleus sampling: smallest set of this much mass")
    top_k: int = _param(-1, Rule(int, ge=-1, what="-1, 0 (off) or a positive int"),
                        "-1, 0 or >= the vocabulary = off")
    min_p: float = _param(0.0, Rule(float, ge=0.0, le=1.0), "drop tokens below this fraction of the top one")
    seed: int | None = _param(None, Rule(int, nullable=True, ge=0, lt=MAX_SEED,
                                         what="a non-negative int below 2**63 - 2**20"),
                              "sample i draws from a generator seeded seed + i")
    repetition_penalty: float = _param(1.0, Rule(float, gt=0.0), "> 1 discourages tokens seen in the prompt or output")
    frequency_penalty: float = _param(0.0, Rule(float, ge=-2.0, le=2.0), "subtracted per occurrence in the output")
    presence_penalty: float = _param(0.0, Rule(float, ge=-2.0, le=2.0), "subtracted once if present in the output")
    max_tokens: int | None = _param(16, Rule(int, nullable=True, ge=1),
                                   "output tokens at most (None = up to the context limit)")
    min_tokens: int = _param(0, Rule(int, ge=0), "EOS, stop_token_ids and stop strings wait for this many tokens")
    stop_token_ids: list[int] = _param([], Rule(list, items=Rule(int, ge=0), what="a list of non-negative ints"),
                                       "token ids that end a sample (as EOS does)")
    ignore_eos: bool = _param(False, Rule(bool), "generate past EOS")
    logprobs: int | None = _param(None, Rule(int, nullable=True, ge=0, le=MAX_LOGPROBS),
                                  "None = off; k >= 0: the sampled token's logprob plus the top k")
    # text: applied by the output processor, not the engine
    stop: list[str] = _param([], Rule(list, items=Rule(str, ge=1), what="a list of non-empty strs"),
                             "strings that end a sample; the text ends before the first one")
    include_stop_str_in_output: bool = _param(False, Rule(bool), "keep the stop string at the end of the text")
    skip_special_tokens: bool = _param(True, Rule(bool), "leave special tokens out of the text")
    # beam search
    use_beam_search: bool = _param(False, Rule(bool), "beam search instead of sampling")
    beam_width: int | None = _param(None, Rule(int, nullable=True, ge=2),
                                    "beams kept per step; None: best_of, else n", beam=True)
    length_penalty: float = _param(1.0, Rule(float),
                                   "finished beams rank by cumulative_logprob / generated_len ** this", beam=True)
    early_stopping: bool | str = _param(False, Rule(bool, choices=("never",), what="True, False or 'never'"),
                                        "True: stop at beam_width finished beams; False: HF's heuristic; 'never'",
                                        beam=True)
    # structured outputs (radixkv/engine/structured.py)
    structured_outputs: StructuredOutputs | None = _param(
        None, Rule(StructuredOutputs, nullable=True, what="a StructuredOutputs"),
        "constrain the output: a JSON schema, json_object, regex, choice or EBNF grammar")

    def __post_init__(self):
        if isinstance(self.stop, str):  # as vLLM: one stop string may be given bare
            self.stop = [self.stop]
        so = self.structured_outputs
        if isinstance(so, dict) and set(so) <= _STRUCTURED_FIELDS:  # as vLLM: the spec may be a dict
            self.structured_outputs = StructuredOutputs(**so)  # (other keys: validate() refuses the dict)

    @property
    def num_samples(self) -> int:
        """Sequences the request runs at once: samples drawn, or beams kept."""
        if self.use_beam_search:
            return self.num_beams
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_beams(self) -> int:
        """Beam width (beam search only)."""
        if self.beam_width is not None:
            return self.beam_width
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise ParamError (a ValueError) naming the first bad field; returns self."""
        validate(self)
        return self


FIELDS = {f.name: f for f in fields(SamplingParams)}
# beam search ranks raw log-probabilities: what would reshape them is not applied, so it is refused
BEAM_NEUTRAL = ("top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def rule(name: str) -> Rule:
    return FIELDS[name].metadata["rule"]


def default(name: str):
    f = FIELDS[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def validate(p: SamplingParams) -> None:
    """Every field against its rule, then the rules between fields; ParamError names the field."""
    for name, f in FIELDS.items():
        v = getattr(p, name)
        if not f.metadata["rule"].admits(v):
            raise ParamError(name, f"{name} must be {f.metadata['rule'].describe()}, got {v!r}")
    if p.best_of is not None and p.best_of < p.n:
        raise ParamError("best_of", f"best_of: must be >= n ({p.n}), got {p.best_of}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ParamError("min_tokens", f"min_tokens: {p.min_tokens} is more than max_tokens ({p.max_tokens})")
    if p.structured_outputs is not None:
        validate_structured_outputs(p.structured_outputs)
        if p.use_beam_search:
            raise ParamError("structured_outputs", "structured_outputs: not supported with use_beam_search")
    if p.use_beam_search:
        _validate_beam_search(p)
        return
    for name, f in FIELDS.items():
        if f.metadata["beam"] and getattr(p, name) != f.default:
            raise ParamError(name, f"{name}: applies to beam search only (set use_beam_search: true)")


def _validate_beam_search(p: SamplingParams) -> None:
    for name in BEAM_NEUTRAL:
        if getattr(p, name) != default(name):
            raise ParamError(name, f"{name}: must be {default(name)} with use_beam_search "
                                   "(beams rank the raw log-probabilities)")
    if p.top_k not in (-1, 0):
        raise ParamError("top_k", "top_k: must be off (-1) with use_beam_search")
    if p.beam_width is not None and p.best_of is not None and p.best_of != p.beam_width:
        raise ParamError("best_of", f"best_of: must equal beam_width ({p.beam_width}) with beam search")
    if p.num_beams < 2:  # as in HF, one beam is greedy search
        raise ParamError("use_beam_search", "use_beam_search: needs at least 2 beams (beam_width, or best_of / n); "
                                            "for one, use greedy sampling (temperature 0)")
    if p.n > p.num_beams:
        raise ParamError("n", f"n: {p.n} is more than the beam width ({p.num_beams})")


# ---- command-line flags (radixkv generate) -------------------------------------------------------

# `--beam-width W` turns beam search on; the flag use_beam_search would only repeat it
_CLI_IMPLIED = ("use_beam_search",)
# no flag: a structured spec is no single command-line value (LLM.generate and the API take it)
_CLI_SKIPPED = ("structured_outputs",)


def add_cli_arguments(sampling_group, beam_group, *, defaults: dict | None = None, helps: dict | None = None) -> None:
    """One flag per field (--max-tokens for max_tokens), its type, default and help from the
    definition; `defaults` / `helps` replace a field's for this command."""
    import argparse

    defaults, helps = defaults or {}, helps or {}
    for name, f in FIELDS.items():
        if name in _CLI_IMPLIED or name in _CLI_SKIPPED:
            continue
        group = beam_group if f.metadata["beam"] else sampling_group
        r, flag = f.metadata["rule"], "--" + name.replace("_", "-")
        value, doc = defaults.get(name, default(name)), helps.get(name, f.metadata["doc"])
        if r.kind is bool and r.choices:  # early_stopping: true, false or a word
            group.add_argument(flag, default=str(value).lower(), choices=("false", "true", *r.choices), help=doc)
        elif r.kind is bool:
            group.add_argument(flag, action="store_true" if value is False else argparse.BooleanOptionalAction,
                               default=value, help=doc)
        elif r.kind is list:
            group.add_argument(flag, action="append", type=r.items.kind, default=None, help=f"{doc} (repeat the flag)")
        else:
            group.add_argument(flag, type=r.kind, default=value, help=doc)


def from_cli_args(args) -> SamplingParams:
    """The SamplingParams of parsed add_cli_arguments flags; the beam fields apply with --beam-width."""
    kw = {name: getattr(args, name) for name in FIELDS if name not in _CLI_IMPLIED and name not in _CLI_SKIPPED}
    kw = {k: v for k, v in kw.items() if v is not None or rule(k).nullable}
    kw["early_stopping"] = {"false": False, "true": True}.get(kw["early_stopping"], kw["early_stopping"])
    beam = args.beam_width is not None
    if not beam:
        kw.update(length_penalty=default("length_penalty"), early_stopping=default("early_stopping"))
    return SamplingParams(use_beam_search=beam, **kw)
