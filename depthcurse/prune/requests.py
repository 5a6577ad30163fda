"""What the engine scores, as token requests: a ppl task's windows, or lm-eval's requests, built
and tokenised once by lm-eval's own code and answered from the engine's log-likelihoods, so that
lm-eval's own filters, metrics and aggregation score every variant."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.prune.layout import TokenRequest
from depthcurse.tasks.base import Score
from depthcurse.tasks.harness import LmEvalTask, quiet_hflm
from depthcurse.tasks.perplexity import PerplexityTask


def lm_eval_token_request(context: list[int], continuation: list[int], max_length: int) -> TokenRequest:
    """What lm-eval's HFLM feeds the model for a (context, continuation) pair, truncated from the left as it does."""
    if not 0 < len(continuation) <= max_length:
        raise DepthcurseError(f"a continuation of {len(continuation)} tokens cannot be scored within the model's {max_length}-token window")
    whole = (list(context) + list(continuation))[-(max_length + 1) :]
    inputs = tuple(whole[:-1])
    return TokenRequest(inputs, len(inputs) - len(continuation), tuple(continuation))


def ppl_requests(task: PerplexityTask) -> list[TokenRequest]:
    """Each window predicts its tokens 1..T-1 from the ones before (the last token is never an input)."""
    return [TokenRequest(tuple(w[:-1]), 0, tuple(w[1:])) for w in task.windows.tolist()]


PRETOKENISED = 4096  # requests whose strings are tokenised together ahead of lm-eval's own loop


def _encoded_strings(context: str, continuation: str) -> list[str]:
    """The strings lm-eval's `_encode_pair` tokenises for a request (its trailing-whitespace move)."""
    if context == "":
        return []
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return [context + continuation, context]


def _request_lm_class():
    class RequestLM(quiet_hflm()):
        """HFLM that records the token requests lm-eval would run, or answers them from a table.

        Recording goes through HFLM's own tokenisation (context/continuation split, trailing
        whitespace moved to the continuation, empty context -> prefix token), so the requests
        are exactly what lm-eval would feed the model.
        """

        answers: dict | None = None
        recorded: dict
        ready: dict = {}  # string -> its tokens, from tok_encode itself, run ahead on threads

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            if self.answers is not None:
                return [self.answers[("ll", *req.args)] for req in requests]
            # lm-eval tokenises each request's context and context+continuation one call at a time
            # (a 5-shot MMLU context once per choice). Its own tok_encode runs first on threads (the
            # tokenizer releases the GIL), each string once; its loop then finds them ready. A
            # string this guesses wrong is only a miss, tokenised in the loop as before.
            out = []
            with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
                for lo in range(0, len(requests), PRETOKENISED):
                    chunk = requests[lo : lo + PRETOKENISED]
                    strings = list(dict.fromkeys(s for req in chunk for s in _encoded_strings(*req.args)))
                    self.ready = dict(zip(strings, pool.map(super().tok_encode, strings)))
                    out += super().loglikelihood(chunk, disable_tqdm=True)
            self.ready = {}
            return out

        def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None, **kwargs):
            if add_special_tokens is None and left_truncate_len is None and not kwargs and string in self.ready:
                return list(self.ready[string])
            return super().tok_encode(string, add_special_tokens=add_special_tokens, left_truncate_len=left_truncate_len, **kwargs)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            for key, context, continuation in requests:
                self.recorded[("ll", *key)] = [(list(context), list(continuation))]
            return [(0.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            if self.answers is not None:
                return [self.answers[("roll", req.args[0])][0] for req in requests]
            from lm_eval import utils  # lazy: lm-eval's modules cost seconds; only its tasks need them

            for req in requests:
                (string,) = req.args
                windows = utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)
                self.recorded[("roll", string)] = [tuple(map(list, utils.make_disjoint_window(w))) for w in windows]
            return [0.0] * len(requests)

    return RequestLM


@contextlib.contextmanager
def _requests_built_once(tasks: dict, built: set, docs: dict):
    """lm-eval rebuilds every request (prompts, few-shot sampling) on each evaluate(), and reads
    every document out of its Arrow table again; build the requests once and keep the documents.

    The instances stay on the task objects; each later evaluate only clears their responses.
    """
    for name, t in tasks.items():

        def build(*args, _t=t, _name=name, **kwargs):
            if _name in built:
                for inst in _t._instances:
                    inst.resps.clear()
                    inst.filtered_resps.clear()
                return None
            built.add(_name)
            return type(_t).build_all_requests(_t, *args, **kwargs)

        def doc_iterator(*args, _t=t, _name=name, **kwargs):
            key = (_name, args, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
            if key not in docs:
                docs[key] = list(type(_t).doc_iterator(_t, *args, **kwargs))
            return iter(docs[key])

        t.build_all_requests, t.doc_iterator = build, doc_iterator
    try:
        yield
    finally:
        for t in tasks.values():
            vars(t).pop("build_all_requests", None)
            vars(t).pop("doc_iterator", None)


class LmEvalRequests:
    """An lm-eval task's requests, tokenised once; scores variants from their log-likelihoods."""

    def __init__(self, task: LmEvalTask, model):
        from lm_eval import evaluator  # lazy: as in RequestLM

        self.task = task
        self.lm = _request_lm_class()(pretrained=model, tokenizer=task.tokenizer, batch_size=task.batch_size)
        self.lm.recorded = {}
        self.built: set = set()
        self.docs: dict = {}  # (task, doc_iterator's arguments) -> its documents, read once
        with _requests_built_once(task.loaded["tasks"], self.built, self.docs):
            evaluator.evaluate(self.lm, task.loaded, limit=task.limit, bootstrap_iters=0)
        max_length = self.lm.max_length
        self.keys = list(self.lm.recorded)
        self.requests: list[TokenRequest] = []
        self.spans: list[tuple[int, int]] = []  # each key's requests (a rolling string has several windows)
        for key in self.keys:
            first = len(self.requests)
            self.requests += [lm_eval_token_request(c, t, max_length) for c, t in self.lm.recorded[key]]
            self.spans.append((first, len(self.requests)))

    def score(self, lp: torch.Tensor, greedy: torch.Tensor) -> Score:
        """lm-eval's metrics for one variant's log-likelihoods [requests] (its own filters and aggregation)."""
        return self.task.score(self.results(lp, greedy, log_samples=getattr(self.task, "per_example", False)))

    def results(self, lp: torch.Tensor, greedy: torch.Tensor, *, log_samples: bool = False) -> dict:
        """lm-eval's raw results dict, as `LmEvalTask.run` returns it, for one variant's log-likelihoods."""
        from lm_eval import evaluator  # lazy: as in RequestLM

        answers = {}
        lps, greedies = lp.tolist(), greedy.tolist()  # one conversion, not one per request
        for key, (a, b) in zip(self.keys, self.spans):
            if key[0] == "ll":
                answers[key] = (lps[a], bool(greedies[a]))
            else:
                answers[key] = (float(lp[a:b].sum()),)
        self.lm.answers = answers
        try:
            with _requests_built_once(self.task.loaded["tasks"], self.built, self.docs):
                results = evaluator.evaluate(self.lm, self.task.loaded, limit=self.task.limit, bootstrap_iters=0, log_samples=log_samples)
        finally:
            self.lm.answers = None
        if results is None:
            raise DepthcurseError("lm-eval returned no results")
        return results
