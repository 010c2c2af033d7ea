"""Grammar-constrained decoding libraries on this CPU: xgrammar vs llguidance (CPU).

What the engine would pay per decode step for structured outputs (JSON schema, json_object,
regex, grammar): token-bitmask computation over SmolLM2-135M-Instruct's real 49,152-token
vocabulary (its GGUF's tokenizer), for each library:

- compile: per case (10 JSON schemas of increasing difficulty, a regex, a GBNF/EBNF grammar and
  a Lark grammar), the time to compile cold (a fresh compiler), again (xgrammar's cache; llguidance
  has none and builds the matcher anew), a new matcher from it, and compile + first mask;
- masks: B matchers (B = 1, 32, 256), each following a valid document of its own case (row i
  takes case i mod N, started at a staggered offset so rows sit in different states); one step
  fills all B rows of one batched int32 bitmask through the library's batched call, then accepts
  one token per row; median and p99 per step, with 1 thread and with --threads; a row whose
  document ends accepts EOS and is replaced by a new matcher between steps (untimed);
- coverage: whether each case compiles, whether its tokenized valid document is accepted token
  by token and then EOS, whether rollback to the start gives the initial mask again;
- jump-forward: what the API offers, the share of a document's tokens that are forced and the
  time of one call.

Timings on a shared 2-core machine are noisy: --repeats runs of the mask loop, medians reported,
load average recorded before and after.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.out_dir import OUT_HELP, out_dir  # noqa: E402

LIBRARIES = ("xgrammar", "llguidance")
VOCAB = 49152


# --- the cases: a schema or grammar, and one valid output for it ------------------------------

def _tool_schema():
    """A tool call to one of 20 functions: {"name": <const>, "arguments": <its parameters>}."""
    kinds = [
        {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "number"}, {"type": "boolean"},
        {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    ]
    names = ["get_weather", "search_web", "send_email", "create_event", "get_stock_price", "translate",
             "book_flight", "cancel_order", "get_directions", "set_reminder", "play_music", "lookup_user",
             "convert_currency", "create_ticket", "get_news", "order_food", "check_inventory", "run_query",
             "resize_image", "summarize_document"]
    functions = []
    for i, name in enumerate(names):
        props = {f"arg_{j}": dict(kinds[(i + j) % len(kinds)], description=f"argument {j} of {name}")
                 for j in range(2 + i % 3)}
        functions.append({"type": "object",
                          "properties": {"name": {"const": name},
                                         "arguments": {"type": "object", "properties": props,
                                                       "required": list(props), "additionalProperties": False}},
                          "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": functions}


JSON_CASES = [
    ("flat_object",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                        "active": {"type": "boolean"}, "score": {"type": "number"}},
      "required": ["name", "age", "active", "score"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "active": True, "score": 97.5}),
    ("nested",
     {"type": "object", "properties": {
         "id": {"type": "integer"},
         "customer": {"type": "object", "properties": {
             "name": {"type": "string"},
             "address": {"type": "object", "properties": {
                 "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"},
                 "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                         "required": ["lat", "lon"]}},
                 "required": ["street", "city", "zip", "geo"]}},
             "required": ["name", "address"]},
         "paid": {"type": "boolean"}},
      "required": ["id", "customer", "paid"]},
     {"id": 1042, "customer": {"name": "Grace Hopper", "address": {"street": "12 Harbor Road", "city": "Arlington",
                                                                   "zip": "22201", "geo": {"lat": 38.88, "lon": -77.1}}},
      "paid": False}),
    ("array_min_items",
     {"type": "object", "properties": {
         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 6},
         "points": {"type": "array", "minItems": 3, "items": {
             "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
             "required": ["x", "y"]}}},
      "required": ["tags", "points"]},
     {"tags": ["geometry", "triangle", "plane"], "points": [{"x": 0, "y": 0}, {"x": 4, "y": 0}, {"x": 0, "y": 3}]}),
    ("enums",
     {"type": "object", "properties": {
         "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
         "language": {"type": "string", "enum": ["en", "fr", "de", "es", "it", "pt", "nl"]},
         "version": {"const": "v2"},
         "priority": {"enum": [1, 2, 3, None]}},
      "required": ["sentiment", "language", "version", "priority"]},
     {"sentiment": "mixed", "language": "fr", "version": "v2", "priority": None}),
    ("any_of",
     {"type": "object", "properties": {
         "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}, {"type": "null"}]},
         "shape": {"anyOf": [
             {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
              "required": ["kind", "radius"]},
             {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                               "h": {"type": "number"}}, "required": ["kind", "w", "h"]}]}},
      "required": ["value", "shape"]},
     {"value": "forty-two", "shape": {"kind": "rect", "w": 3.5, "h": 2}}),
    ("refs_defs",
     {"$defs": {
         "node": {"type": "object", "properties": {"label": {"type": "string"},
                                                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                  "required": ["label", "children"]},
         "person": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                    "required": ["name"]}},
      "type": "object", "properties": {"owner": {"$ref": "#/$defs/person"}, "tree": {"$ref": "#/$defs/node"}},
      "required": ["owner", "tree"]},
     {"owner": {"name": "Linus", "email": "linus@example.org"},
      "tree": {"label": "root", "children": [{"label": "a", "children": [{"label": "a1", "children": []}]},
                                             {"label": "b", "children": []}]}}),
    ("patterns_formats",
     {"type": "object", "properties": {
         "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
         "email": {"type": "string", "format": "email"},
         "date": {"type": "string", "format": "date"},
         "uuid": {"type": "string", "format": "uuid"},
         "code": {"type": "string", "minLength": 4, "maxLength": 8},
         "qty": {"type": "integer", "minimum": 1, "maximum": 999}},
      "required": ["sku", "email", "date", "uuid", "code", "qty"]},
     {"sku": "ABC-1234", "email": "ops@example.com", "date": "2024-02-29",
      "uuid": "123e4567-e89b-12d3-a456-426614174000", "code": "x7Kp2", "qty": 12}),
    ("numbers_bounds",
     {"type": "object", "properties": {
         "ratio": {"type": "number", "minimum": 0, "maximum": 1},
         "temp": {"type": "number", "exclusiveMinimum": -273.15},
         "count": {"type": "integer", "minimum": 10, "maximum": 20},
         "even": {"type": "integer", "multipleOf": 2}},
      "required": ["ratio", "temp", "count", "even"]},
     {"ratio": 0.25, "temp": 21.5, "count": 15, "even": 42}),
    ("tool_call_20", _tool_schema(),
     {"name": "get_news", "arguments": {"arg_0": 7.5, "arg_1": True, "arg_2": "kelvin", "arg_3": ["world", "tech"]}}),
    ("json_object", {"type": "object"},
     {"model": "smollm2", "tags": ["small", "fast"], "stats": {"params": 135000000, "ratio": 0.5, "ok": True},
      "notes": None}),
]
# coverage probes (one keyword each: schema, a valid and an invalid document), left out of the mask loop
PROBES = [
    ("kw_unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [3, 1, 2], [3, 3]),
    ("kw_pattern_properties", {"type": "object", "patternProperties": {"^x-": {"type": "string"}},
                               "additionalProperties": False}, {"x-trace": "abc"}, {"y": "abc"}),
    ("kw_one_of", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ("kw_not", {"type": "object", "properties": {"v": {"not": {"type": "null"}}}, "required": ["v"]},
     {"v": "x"}, {"v": None}),
    ("kw_min_properties", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2,
                           "maxProperties": 3}, {"a": 1, "b": 2}, {"a": 1}),
    ("kw_if_then_else", {"type": "object", "properties": {"k": {"type": "string"}, "n": {"type": "integer"}},
                         "if": {"properties": {"k": {"const": "int"}}}, "then": {"required": ["n"]}},
     {"k": "int", "n": 4}, {"k": "int"}),
]
# (name, kind, source, valid output); GBNF is given to both (llguidance converts it to Lark)
GRAMMAR_CASES = [
    ("regex_phone", "regex", r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?", "(555) 123-4567 ext. 89"),
    ("ebnf_arith", "ebnf",
     'root ::= expr\n'
     'expr ::= term (("+" | "-") term)*\n'
     'term ::= factor (("*" | "/") factor)*\n'
     'factor ::= number | "(" expr ")" | "-" factor\n'
     'number ::= [0-9]+ ("." [0-9]+)?\n',
     "(3+4)*12-7/(2+0.5)*-(10-4)"),
    ("lark_sql", "lark",
     'start: "SELECT " cols " FROM " NAME (" WHERE " cond)? ";"\n'
     'cols: "*" | NAME (", " NAME)*\n'
     'cond: NAME " " OP " " value (" AND " cond)?\n'
     'value: NUMBER | STRING\n'
     'OP: "=" | "<" | ">" | "<=" | ">="\n'
     'NAME: /[a-z_][a-z0-9_]*/\n'
     'NUMBER: /[0-9]+/\n'
     "STRING: /'[^']*'/\n",
     "SELECT name, email FROM users WHERE age >= 21 AND city = 'Paris';"),
]


def cases() -> list[dict]:
    out = [{"name": n, "kind": "json_object" if n == "json_object" else "json_schema", "source": s,
            "doc": json.dumps(d, indent=2 if n == "nested" else None)} for n, s, d in JSON_CASES]
    out += [{"name": n, "kind": k, "source": s, "doc": d} for n, k, s, d in GRAMMAR_CASES]
    out += [{"name": n, "kind": "json_schema", "source": s, "doc": json.dumps(d), "probe": True, "invalid": json.dumps(b)}
            for n, s, d, b in PROBES]
    return out


# --- the two libraries behind one small interface --------------------------------------------

class Xgrammar:
    name = "xgrammar"
    jump_forward_api = ("GrammarMatcher.find_jump_forward_string() (forced text) and find_jump_forward_tokens() "
                        "(forced text as vocabulary tokens); neither changes the matcher state")

    def __init__(self, tok, threads: int):
        import xgrammar as xgr
        self.xgr = xgr
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.tokenizer_s = time.perf_counter() - t
        self.threads = threads
        self.eos = list(self.info.stop_token_ids)[0]
        self._batch = {}

    def compiler(self):
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=True)

    def compile(self, compiler, case):
        k, s = case["kind"], case["source"]
        if k in ("json_schema", "json_object"):
            return compiler.compile_json_schema(json.dumps(s), any_whitespace=True)
        if k == "regex":
            return compiler.compile_regex(s)
        if k == "ebnf":
            return compiler.compile_grammar(s)
        if k == "lark":
            return compiler.compile_lark(s)
        raise ValueError(k)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def error(self, m):
        return None

    def fill(self, matchers, bitmask, threads):
        if threads not in self._batch:
            self._batch[threads] = self.xgr.BatchGrammarMatcher(max_threads=threads)
        self._batch[threads].batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, m, bitmask, row=0):
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token):
        return m.accept_token(token)

    def finish(self, m):
        return m.accept_token(self.eos) and m.is_terminated()

    def jump_forward(self, m):
        return m.find_jump_forward_tokens()

    def rollback(self, m, n):
        m.rollback(n)

    def fork(self, m):
        return m.fork()


class Llguidance:
    name = "llguidance"
    jump_forward_api = ("LLMatcher.compute_ff_tokens() (forced tokens) and compute_ff_bytes() (forced bytes); "
                        "try_consume_tokens()/validate_tokens() check a draft")

    def __init__(self, tok, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.llt = llguidance.torch
        t = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.tokenizer_s = time.perf_counter() - t
        self.threads = threads
        self.eos = self.tokenizer.eos_token
        self._executors = {}

    def compiler(self):
        return None  # no compiled-grammar cache: a matcher is built from the grammar text each time

    def compile(self, compiler, case):
        M, k, s = self.llg.LLMatcher, case["kind"], case["source"]
        if k in ("json_schema", "json_object"):
            grammar = M.grammar_from_json_schema(json.dumps(s), defaults={"whitespace_flexible": True})
        elif k == "regex":
            grammar = M.grammar_from_regex(s)
        elif k == "ebnf":
            grammar = self.llg.grammar_from("gbnf", s)
        elif k == "lark":
            grammar = M.grammar_from_lark(s)
        else:
            raise ValueError(k)
        m = M(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m  # the template matcher; requests get deep copies

    def matcher(self, compiled):
        return compiled.deep_copy()

    def error(self, m):
        return m.get_error() if m.is_error() else None

    def fill(self, matchers, bitmask, threads):
        if threads not in self._executors:
            self._executors[threads] = self.llg.LLExecutor(num_threads=threads)
        self.llt.fill_next_token_bitmask_par(self._executors[threads], [(m, i) for i, m in enumerate(matchers)],
                                             bitmask)

    def fill_one(self, m, bitmask, row=0):
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m, token):
        return m.consume_token(token)

    def finish(self, m):
        return m.is_accepting() and m.consume_token(self.eos)

    def jump_forward(self, m):
        return m.compute_ff_tokens()

    def rollback(self, m, n):
        m.rollback(n)

    def fork(self, m):
        return m.deep_copy()


BACKENDS = {"xgrammar": Xgrammar, "llguidance": Llguidance}


# --- measurements ----------------------------------------------------------------------------

def _ms(xs):
    xs = sorted(xs)
    if not xs:
        return {"median": None, "p99": None}
    return {"median": round(1e3 * statistics.median(xs), 4),
            "p99": round(1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 4)}


def _version(lib):
    try:
        return importlib.metadata.version(lib)
    except importlib.metadata.PackageNotFoundError:
        return None


def measure_compile(be, case, repeats):
    """Cold (fresh compiler), again (same compiler: xgrammar's cache), new matcher, compile + first mask."""
    import torch
    cold, again, new, first = [], [], [], []
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    compiled = None
    for _ in range(repeats):
        comp = be.compiler()
        t0 = time.perf_counter()
        compiled = be.compile(comp, case)
        t1 = time.perf_counter()
        m = be.matcher(compiled)
        t2 = time.perf_counter()
        be.fill_one(m, bitmask)
        t3 = time.perf_counter()
        be.compile(comp, case)
        t4 = time.perf_counter()
        cold.append(t1 - t0)
        first.append(t3 - t0)
        new.append(t2 - t1)
        again.append(t4 - t3)
    med = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return compiled, {"cold_ms": med(cold), "cached_ms": med(again), "new_matcher_ms": med(new),
                      "compile_first_mask_ms": med(first)}


def coverage_and_single(be, compiled, tokens, tok):
    """Feed the valid document token by token at batch 1: acceptance, EOS, rollback, jump-forward."""
    import torch
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    m = be.matcher(compiled)
    be.fill_one(m, bitmask)
    initial = bitmask.clone()
    fills, accepts, ff_times, forced = [], [], [], 0
    rejected = None
    for pos, t in enumerate(tokens):
        t0 = time.perf_counter()
        be.fill_one(m, bitmask)
        t1 = time.perf_counter()
        allowed = bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1)
        t2 = time.perf_counter()
        ok = be.accept(m, t)
        t3 = time.perf_counter()
        fills.append(t1 - t0)
        accepts.append(t3 - t2)
        if not (ok and allowed):
            rejected = {"pos": pos, "token": tok.decode([t]), "in_mask": allowed, "accepted": bool(ok),
                        "error": (be.error(m) or "")[:300]}
            break
        if pos + 1 < len(tokens):
            t4 = time.perf_counter()
            ff = be.jump_forward(m)
            ff_times.append(time.perf_counter() - t4)
            forced += bool(ff) and ff[0] == tokens[pos + 1]
    row = {"tokens": len(tokens), "accepted_tokens": len(accepts) if rejected is None else rejected["pos"],
           "rejected": rejected, "fill_1": _ms(fills), "accept_1": _ms(accepts), "jump_forward_call": _ms(ff_times),
           "forced_next_token_share": round(forced / max(1, len(tokens) - 1), 3)}
    if rejected is None:
        fork = be.fork(m)
        row["eos_accepted"] = bool(be.finish(fork))
        try:
            be.rollback(m, len(tokens))
            be.fill_one(m, bitmask)
            row["rollback_to_start_ok"] = bool(torch.equal(bitmask, initial))
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row["rollback_to_start_ok"] = f"error: {e}"
    row["accepted"] = rejected is None and row.get("eos_accepted", False)
    return row


def measure_masks(be, compiled, docs, batch, steps, threads):
    """One run: `batch` rows, row i on case i mod N at a staggered offset; per step a batched fill of
    all rows, then one accepted token per row. Returns per-step seconds (fill, accept, total)."""
    import torch
    n = len(compiled)
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    rows = []
    for i in range(batch):
        c = i % n
        m = be.matcher(compiled[c])
        offset = (i // n * 13 + i * 7) % len(docs[c]) if batch > 1 else 0
        for t in docs[c][:offset]:
            be.accept(m, t)
        rows.append([m, c, offset])
    fills, accepts, totals, failures = [], [], [], 0
    matchers = [r[0] for r in rows]
    for _ in range(steps):
        t0 = time.perf_counter()
        be.fill(matchers, bitmask, threads)
        t1 = time.perf_counter()
        for r in rows:
            failures += not be.accept(r[0], docs[r[1]][r[2]])
            r[2] += 1
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
        totals.append(t2 - t0)
        for i, r in enumerate(rows):  # a finished request leaves; a new one takes its row (untimed)
            if r[2] == len(docs[r[1]]):
                be.finish(r[0])
                r[0] = matchers[i] = be.matcher(compiled[r[1]])
                r[2] = 0
    return fills, accepts, totals, failures


def run_coverage(lib, tok, selected, args):
    """Compile times, coverage and batch-1 figures per case; returns the row and what the mask loop needs."""
    be = BACKENDS[lib](tok, args.threads)
    out = {"library": lib, "version": _version(lib), "tokenizer_info_s": round(be.tokenizer_s, 3),
           "jump_forward_api": be.jump_forward_api, "cases": {}, "masks": []}
    ready = {}
    for case in selected:
        tokens = tok.encode(case["doc"], add_special_tokens=False)
        row = {"kind": case["kind"]}
        try:
            cg, times = measure_compile(be, case, args.compile_repeats)
            row.update(compiles=True, **times)
        except Exception as e:  # noqa: BLE001 - an unsupported schema is a coverage result
            row.update(compiles=False, error=f"{type(e).__name__}: {e}"[:300], accepted=False)
            out["cases"][case["name"]] = row
            print(f"  {lib:10s} {case['name']:21s} does not compile: {row['error'][:120]}", flush=True)
            continue
        row.update(coverage_and_single(be, cg, tokens, tok))
        if "invalid" in case:  # the keyword is enforced when its invalid document is refused, EOS included
            bad = coverage_and_single(be, cg, tok.encode(case["invalid"], add_special_tokens=False), tok)
            row["invalid_refused"] = not bad["accepted"]
        out["cases"][case["name"]] = row
        print(f"  {lib:10s} {case['name']:21s} cold {row['cold_ms']:9.2f} ms  cached {row['cached_ms']:8.3f} ms  "
              f"1st mask {row['compile_first_mask_ms']:9.2f} ms  mask@1 {row['fill_1']['median']} ms  "
              f"accepted {row['accepted']}", flush=True)
        if row["accepted"] and not case.get("probe"):
            ready[case["name"]] = (cg, tokens)
    return be, out, ready


def run_masks(be, out, ready, names, args):
    """The batched loop over the cases every library accepted (the same workload for each)."""
    lib = out["library"]
    out["mask_cases"] = names
    compiled, docs = [ready[n][0] for n in names], [ready[n][1] for n in names]
    if not compiled:
        return
    for threads in sorted({1, args.threads}):
        for batch in args.batches:
            runs = [measure_masks(be, compiled, docs, batch, args.steps, threads) for _ in range(args.repeats)]
            stat = {k: [_ms(r[j]) for r in runs] for j, k in enumerate(("fill", "accept", "step"))}
            row = {"threads": threads, "batch": batch, "steps": args.steps, "repeats": args.repeats,
                   "failures": sum(r[3] for r in runs)}
            for k, per_run in stat.items():
                row[f"{k}_ms"] = {q: round(statistics.median(s[q] for s in per_run), 4) for q in ("median", "p99")}
            out["masks"].append(row)
            print(f"  {lib:10s} threads {threads} batch {batch:4d}: step {row['step_ms']['median']:8.3f} ms "
                  f"(fill {row['fill_ms']['median']:.3f} + accept {row['accept_ms']['median']:.3f}), "
                  f"p99 {row['step_ms']['p99']:.3f} ms, failures {row['failures']}", flush=True)


def load_tokenizer():
    from transformers import AutoTokenizer

    from radixkv.models.smollm2 import missing_message, smollm2_gguf
    path = smollm2_gguf()
    if path is None:
        raise SystemExit(missing_message())
    folder, name = os.path.split(path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name), path


def markdown(result) -> str:
    libs = result["libraries"]
    names = ", ".join(f"{r['library']} {r['version']}" for r in libs)
    lines = [f"# Grammar masks: {names}", "",
             f"SmolLM2-135M-Instruct tokenizer (vocab {VOCAB}), {result['cpu']}, torch {result['torch']}, "
             f"load average {result['load_before']} before, {result['load_after']} after.", "",
             "## Compile (ms, median of repeats) and coverage", "",
             "| case | " + " | ".join(f"{r['library']} cold / cached / 1st mask / ok" for r in libs) + " |",
             "|---|" + "---|" * len(libs)]
    for name in result["cases"]:
        cells = []
        for r in libs:
            c = r["cases"].get(name, {})
            if not c.get("compiles"):
                cells.append(f"no: {c.get('error', '')[:60]}")
                continue
            rej = c.get("rejected") or {}
            ok = "yes" if c.get("accepted") else f"valid doc REJECTED at token {rej.get('pos')} {rej.get('token')!r}"
            if "invalid_refused" in c:
                ok += ", invalid doc " + ("refused" if c["invalid_refused"] else "ACCEPTED (keyword ignored)")
            cells.append(f"{c['cold_ms']:.2f} / {c['cached_ms']:.3f} / {c['compile_first_mask_ms']:.2f} / {ok}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Mask per step at batch 1 per case (ms, median; forced share = next token forced)", "",
              "| case | " + " | ".join(f"{r['library']} fill / accept / forced" for r in libs) + " |",
              "|---|" + "---|" * len(libs)]
    for name in result["cases"]:
        cells = []
        for r in libs:
            c = r["cases"].get(name, {})
            cells.append(f"{c['fill_1']['median']:.4f} / {c['accept_1']['median']:.4f} / "
                         f"{c['forced_next_token_share']}" if c.get("accepted") else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Batched fill + accept per step (ms; median of per-run medians / p99)", "",
              "| library | threads | batch | step median | step p99 | fill median | accept median | failures |",
              "|---|---|---|---|---|---|---|---|"]
    for r in libs:
        for m in r["masks"]:
            lines.append(f"| {r['library']} | {m['threads']} | {m['batch']} | {m['step_ms']['median']:.3f} | "
                         f"{m['step_ms']['p99']:.3f} | {m['fill_ms']['median']:.3f} | {m['accept_ms']['median']:.3f} "
                         f"| {m['failures']} |")
    lines += ["", "## Jump-forward", ""] + [f"- {r['library']}: {r['jump_forward_api']}" for r in libs]
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated: xgrammar,llguidance")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--batches", default="1,32,256", help="batch sizes of the mask loop")
    p.add_argument("--steps", type=int, default=96, help="steps per mask-loop run")
    p.add_argument("--repeats", type=int, default=3, help="mask-loop runs per (threads, batch); medians reported")
    p.add_argument("--compile-repeats", type=int, default=3, help="compiles per case; medians reported")
    p.add_argument("--threads", type=int, default=2, help="threads of the multi-threaded fill (and of xgrammar's "
                                                        "compiler); 1-thread figures are always measured too")
    p.add_argument("--out", default=None, help=OUT_HELP)


def main(args=None) -> int:
    if not isinstance(args, argparse.Namespace):
        p = argparse.ArgumentParser(prog="radixkv bench grammar-masks", description=__doc__.splitlines()[0])
        add_arguments(p)
        args = p.parse_args(args)
    if isinstance(args.batches, str):
        args.batches = [int(b) for b in args.batches.split(",")]
    import torch
    torch.set_num_threads(1)
    all_cases = cases()
    names = args.cases.split(",") if args.cases else [c["name"] for c in all_cases]
    unknown = set(names) - {c["name"] for c in all_cases}
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {[c['name'] for c in all_cases]}")
    selected = [c for c in all_cases if c["name"] in names]
    libs = [lib for lib in args.libraries.split(",") if lib]
    load_before = [round(x, 2) for x in os.getloadavg()]
    tok, gguf = load_tokenizer()
    result = {"gguf": os.path.basename(gguf), "vocab": VOCAB, "cpu": f"{platform.processor() or platform.machine()}"
              f", {os.cpu_count()} CPUs", "python": platform.python_version(), "torch": torch.__version__,
              "load_before": load_before, "cases": {c["name"]: {"kind": c["kind"], "doc": c["doc"]} for c in selected},
              "libraries": [], "skipped": {}}
    runs = []
    for lib in libs:
        try:
            importlib.import_module(lib)
        except ImportError as e:
            result["skipped"][lib] = str(e)
            print(f"  {lib}: not importable ({e}); skipped", flush=True)
            continue
        runs.append(run_coverage(lib, tok, selected, args))
    common = [c["name"] for c in selected if all(c["name"] in ready for _, _, ready in runs)]
    for be, out, ready in runs:
        run_masks(be, out, ready, common, args)
        result["libraries"].append(out)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    folder = out_dir(args.out, "grammar-masks")
    (folder / "grammar_masks.json").write_text(json.dumps(result, indent=1))
    (folder / "grammar_masks.md").write_text(markdown(result))
    print(f"results in {folder}/grammar_masks.*")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
