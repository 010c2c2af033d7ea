"""LLM: the offline API. Prompts (text or token ids) in, finished outputs with text out.

    llm = LLM("path/to/model", num_blocks=512)   # an HF folder or a .gguf file
    outs = llm.generate(["Hello", "The sky"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].num_cached_tokens

Parallel sampling (n, best_of) and beam search (use_beam_search, beam_width, length_penalty,
early_stopping) come back as several outputs per prompt; beam search's are best first.

Text comes from the output processor the HTTP front uses too (radixkv/output_processor.py):
the same incremental detokenizer, and stop strings (`SamplingParams(stop=[...])`): an output
ends before the first stop string (after it with include_stop_str_in_output), with
finish_reason "stop" and token_ids up to the token that completed it, as the server answers.
Once every output of a prompt has ended so, its engine request is aborted and decodes no more.
A sample stopped while its siblings (n > 1) run on is ignored from then on; its
cumulative_logprob still counts what the engine generated for it meanwhile.

A prompt the engine fails (an internal error, logged on the "radixkv.engine" logger) comes
back finished with finish_reason "error" on every output it had not finished; the other
prompts are unaffected.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.errors import is_device_error
from radixkv.engine.outputs import CompletionOutput, RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.models.source import load_tokenizer
from radixkv.output_processor import OutputProcessor

logger = logging.getLogger("radixkv.engine")


class LLM:
    def __init__(self, model_dir: str, **engine_args):
        """model_dir: an HF folder, a .gguf file, or a folder holding one .gguf."""
        self.engine = Engine(EngineConfig(model_dir=model_dir, **engine_args))
        self.tokenizer = load_tokenizer(model_dir)
        self._ids = itertools.count()

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer (tokenizer files in the model folder, or a GGUF)")
            return prompt, self.tokenizer(prompt)["input_ids"]
        return None, list(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; text, a list of token ids, or a list of either.
        Bad input raises ValueError naming the prompt and adds nothing. Returns one finished
        output per prompt, in order; a prompt the engine failed has finish_reason "error" on
        every output it had not finished (what it streamed before stays in token_ids)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty str, list of token ids, or list of those")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        texts, rids, failed, procs = {}, [], {}, {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid, text, ids = f"llm-{next(self._ids)}", None, []
                try:
                    text, ids = self._prompt_ids(prompt)
                    if isinstance(p, SamplingParams) and p.stop and self.tokenizer is None:
                        raise ValueError("stop: stop strings need a tokenizer (tokenizer files in the model folder, "
                                         "or a GGUF)")
                    self.engine.add_request(rid, ids, p, cache_salt=cache_salt)
                    if self.tokenizer is not None:
                        procs[rid] = [OutputProcessor(self.tokenizer, ids, p) for _ in range(p.n)]
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
                except Exception as e:
                    if is_device_error(e):
                        raise
                    logger.exception("prompts[%d] could not be added; it fails", i)
                    failed[rid] = _failed_output(rid, ids, p)
                rids.append(rid)
                texts[rid] = text
        except ValueError:
            for rid in rids:  # all or nothing
                self.engine.abort_request(rid)
            self.engine.step()  # drain the aborts' outputs
            raise
        return self._run(rids, texts, failed, procs)

    def _run(self, rids: list[str], texts: dict, failed: dict[str, RequestOutput],
             procs: dict[str, list[OutputProcessor]]) -> list[RequestOutput]:
        pending = set(rids) - set(failed)
        logprobs: dict[tuple[str, int], list] = {}
        done = {rid: replace(out, prompt=texts[rid]) for rid, out in failed.items()}
        while pending:
            for out in self.engine.step():
                rid, choices = out.request_id, procs.get(out.request_id)
                for c in out.outputs:
                    took = len(c.new_token_ids)
                    if choices is not None:
                        before = choices[c.index].num_tokens
                        choices[c.index].process(c.new_token_ids, c.finish_reason)
                        took = choices[c.index].num_tokens - before  # none past a stop string
                    if c.logprobs is not None:
                        logprobs.setdefault((rid, c.index), []).extend(c.logprobs[:took])
                if out.finished and rid in pending:
                    pending.discard(rid)
                    done[rid] = self._final(out, texts[rid], logprobs, choices)
                elif choices is not None and all(ch.finished for ch in choices):
                    self.engine.abort_request(rid)  # every output met a stop string: decode no more
        return [done[r] for r in rids]

    def _final(self, out: RequestOutput, prompt: str | None, logprobs: dict,
               choices: list[OutputProcessor] | None) -> RequestOutput:
        completions = []
        for c in out.outputs:
            lps = c.logprobs if c.logprobs is None else logprobs.get((out.request_id, c.index), c.logprobs)
            ids, text, finish = list(c.token_ids), None, c.finish_reason
            if choices is not None:
                ch = choices[c.index]
                text, finish = ch.text, ch.finish_reason or c.finish_reason
                if ch.stopped_by_string:
                    ids = ids[: ch.num_tokens]
            completions.append(CompletionOutput(c.index, ids, list(ids), lps, finish, c.cumulative_logprob, text))
        return replace(out, outputs=completions, finished=True, prompt=prompt)


def _failed_output(request_id: str, prompt_token_ids: list[int], params) -> RequestOutput:
    """The output of a prompt the engine could not even add."""
    n = params.n if isinstance(params, SamplingParams) else 1
    completions = [CompletionOutput(i, [], [], None, "error", 0.0, "") for i in range(n)]
    return RequestOutput(request_id, completions, list(prompt_token_ids), 0, True)
