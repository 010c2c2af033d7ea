"""Structured outputs: grammar-constrained decoding through xgrammar.

One Grammars per engine. At the first constrained request it loads the model's tokenizer (an HF
folder's files, or a GGUF's own vocabulary: radixkv.models.source) and builds xgrammar's
TokenizerInfo (over the model's vocabulary, the padded ids included, with the engine's EOS ids as
the grammar's stop tokens) and one GrammarCompiler. A request's StructuredOutputs is compiled when
the request is added (a bad schema, regex or grammar: ParamError naming the field), and kept by
its spec, so a repeated schema compiles once. Every sequence of the request gets its own
GrammarMatcher (the samples of n > 1 each a fresh one: they fork off the prompt, before any
output token).

Per step: fill_bitmask() fills the token bitmask of the constrained rows (host, xgrammar's
fill_next_token_bitmask; reads the matcher, changes nothing, so a step computed again after a
fault fills the same), the sampler applies it on the device to those rows only
(apply_bitmask), and the engine feeds each appended token to its matcher (accept()); a matcher
that is terminated ends the sequence with "stop". JSON comes out compact (no free whitespace:
a model, tiny or not, cannot wander off in blanks).

NOTE: preemption keeps a sequence's token_ids (its prompt and output are computed again, nothing
is sampled again), so the matcher, which has accepted exactly the output tokens, keeps its
state: nothing to roll back. The overlapped loop runs a step with a constrained row
synchronously (engine.py), so a matcher has always accepted the last token before its next
mask is filled.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

from radixkv.engine.errors import ParamError
from radixkv.sampling_params import StructuredOutputs

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ParamError("structured_outputs", "structured_outputs: needs xgrammar "
                                               "(pip install 'radixkv[structured]')") from None
    return xgrammar


def _reason(exc: Exception) -> str:
    """xgrammar's message without its time stamp and source location."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())


def cache_key(so: StructuredOutputs) -> tuple[str, str]:
    kind = so.kind
    if kind == "json":
        return kind, json.dumps(so.schema(), sort_keys=True)
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, json.dumps(list(so.choice))
    return kind, getattr(so, kind)


# a JSON string's characters without escapes: what xgrammar's own rule for a length-bounded string
# admits, less the control characters JSON forbids unescaped
_PLAIN_CHARS = '[^\\x00-\\x1f"\\\\]'
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames")


def bounded_strings_as_patterns(schema):
    """The schema with each string bounded by minLength / maxLength (and no pattern or format)
    turned into a pattern of as many plain characters.

    NOTE: xgrammar 0.2.9 builds such a string from `[^"\\\r\n]{min,max}`, which admits the
    control characters U+0000-U+001F that JSON allows only escaped: a model can emit text no
    strict JSON parser reads. The pattern keeps the same lengths (no escapes, as xgrammar's rule)
    without them."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: bounded_strings_as_patterns(sub) for name, sub in v.items()}
        elif k in _SCHEMA_LISTS or k in _SCHEMA_ONE:
            out[k] = bounded_strings_as_patterns(v)
        else:
            out[k] = v
    lo, hi = out.get("minLength"), out.get("maxLength")
    if out.get("type") == "string" and (lo is not None or hi is not None) and "pattern" not in out \
            and "format" not in out and all(isinstance(x, int) for x in (lo or 0, hi or 0)):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHARS}{{{lo or 0},{'' if hi is None else hi}}}$"
    return out


def choice_grammar(choices) -> str:
    """EBNF whose language is exactly the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids):
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, list(eos_token_ids)
        self._compiler = None
        self._compiled: OrderedDict = OrderedDict()

    @property
    def compiler(self):
        if self._compiler is None:
            xgr = _import_xgrammar()
            from radixkv.models.source import load_tokenizer

            tokenizer = load_tokenizer(self.model_dir)
            if tokenizer is None:
                raise ParamError("structured_outputs", "structured_outputs: needs the model's tokenizer "
                                                       "(tokenizer files in the model folder, or a GGUF)")
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the cache is ours
        return self._compiler

    def compile(self, so: StructuredOutputs):
        """The compiled grammar of a validated spec; ParamError naming the field if it does not compile."""
        key = cache_key(so)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        c, kind = self.compiler, key[0]
        try:
            if kind == "json":
                schema = json.dumps(bounded_strings_as_patterns(so.schema()))
                compiled = c.compile_json_schema(schema, any_whitespace=False)
            elif kind == "json_object":
                # an object (as OpenAI's json_object), any members; compact, as the schemas
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif kind == "regex":
                compiled = c.compile_regex(so.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(choice_grammar(so.choice))
            else:
                compiled = c.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ParamError(f"structured_outputs.{kind}",
                             f"structured_outputs.{kind}: does not compile: {_reason(e)}") from None
        self._compiled[key] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    @staticmethod
    def matcher(compiled):
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)


def fill_bitmask(seqs, vocab_size: int):
    """(bitmask [rows, ceil(vocab / 32)] int32 on the host, the constrained rows), or None when no
    row of `seqs` is constrained."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(seqs), vocab_size)
    for i in rows:
        seqs[i].matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask, rows


def apply_bitmask(logits, bitmask, rows) -> None:
    """In place: the tokens the grammar forbids to -inf, in the constrained rows only."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                         vocab_size=logits.shape[1], indices=rows)


def accept(seq, token: int) -> bool:
    """Feed an appended token to the sequence's matcher; True when the grammar is complete."""
    m = seq.matcher
    if not m.accept_token(token):
        raise RuntimeError(f"token {token} is not allowed by the grammar of request {seq.request.request_id}")
    return m.is_terminated()
