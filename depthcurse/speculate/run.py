"""`depthcurse speculate`: the model drafting for itself with blocks skipped, against decoding alone
and against the other drafts, on the same prompts, timed in turns, every greedy output checked.

For each prompt, in an order that turns round from one prompt to the next (so that no method always
runs first on a machine that warms up or slows down):
- `generate`: transformers' own `model.generate`, greedy (the reference every greedy output must
  equal token for token) or sampling;
- `plain`: the whole model alone, in the loop the drafts run in (`decoding.plain`): the time every
  draft's speedup is measured against, so that a speedup is the draft's and not a loop's;
- each draft (`decoding.speculative`): the self-draft (`--skip`), and the baselines: early exit
  (the same number of blocks skipped, the last ones: LayerSkip's draft), prompt lookup, an
  assistant model of the same tokenizer (`--assistant`, also through transformers' own assisted
  decoding, against `generate`).
Every finished prompt is written to `speculate.json` at once: an interrupted run resumes after the
prompts it finished. Under torchrun the prompts are shared over the ranks, each rank with its own
copy of the model and its own drafts, and every finished round of prompts gathered on rank 0.
`summary` turns the prompts into the table's figures.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from depthcurse.errors import DepthcurseError
from depthcurse.forecast import Forecast, took_up
from depthcurse.few_row_linear import few_row_kernel
from depthcurse.io import atomic_write, ensure_out_dir, environment, json_text, refuse_other_run
from depthcurse.kept_state import identity_of, tensors_digest
from depthcurse.loading import max_positions
from depthcurse.runtime import World
from depthcurse.speculate.decoding import DecodeSettings, Generation, plain, speculative
from depthcurse.speculate.draft import Draft, Stopwatch
from depthcurse.speculate.drafts import LayerSkipDraft, PromptLookupDraft
from depthcurse.speculate.lengths import POLICIES, build_length
from depthcurse.speculate.prompts import KINDS, Prompt, load_prompts
from depthcurse.speculate.summary import summarise
from depthcurse.surgery import num_layers, parse_removal, run_text, runs_of

# Why `--dtype auto` is fp32 on a CPU here (runtime.pick_dtype): bf16's check of several tokens and
# its one-token step round a near-tie differently, so the greedy output is not model.generate's
# token for token (docs/benchmarks.md, "bf16 against fp32 on every command").
FP32_ON_CPU = "as speculate checks its output against model.generate token for token, which bf16's rounding breaks on near-ties"


SPECULATE_JSON = "speculate.json"
BASELINES = ("early-exit", "prompt-lookup")  # and "assistant" where --assistant names one
WARMUP_TOKENS = 8


@dataclass
class SpeculateConfig:
    skip: tuple  # what the self-draft skips: block indices, or branches ("a3", "m7")
    draft_tokens: int = 4  # gamma (fixed), the most a round drafts (confidence), the first round's (heuristic)
    draft_length: str = "fixed"  # POLICIES
    max_new_tokens: int = 64
    prompts: str = "suite"  # the suite, or a file
    per_kind: int = 4
    kinds: tuple[str, ...] = KINDS
    baselines: tuple[str, ...] = BASELINES
    assistant: str | None = None  # the assistant model as given (loaded by the caller)
    temperature: float = 0.0  # 0: greedy; above: sampling (--sample)
    ngram: int = 2  # prompt lookup's longest n-gram (transformers' max_matching_ngram_size default)
    stop_at_eos: bool = True
    seed: int = 1234  # each prompt's sampling seed is seed + its index
    skip_from: str | None = None  # the select run the skip set was read from
    also: tuple = ()  # other skip sets, each another self-draft ("self-draft #2", ...) set against the first on the same prompts

    def checked(self, n_layers: int | None = None) -> "SpeculateConfig":
        """The config, or one line on what is wrong with it; given the model's layers, the skip set too."""
        if n_layers is not None:
            if not self.skip:
                raise DepthcurseError("--skip names no block: the draft would be the model itself")
            outside = [u for u in self.skip if not 0 <= (int(u[1:]) if isinstance(u, str) else u) < n_layers]
            if outside:
                raise DepthcurseError(f"--skip: {outside[0]} is not a block of the model's {n_layers} (0-{n_layers - 1})")
            if not isinstance(self.skip[0], str) and len(set(self.skip)) == n_layers:
                raise DepthcurseError(f"--skip {run_text_of(self.skip)} skips every one of the {n_layers} blocks: the draft would run none")
            for other in self.also:
                if tuple(other) == tuple(self.skip) or list(self.also).count(other) > 1:
                    raise DepthcurseError(f"--also-skip {run_text_of(other)} is a self-draft named twice: each would be measured twice, as if two")
        unknown = [k for k in self.kinds if k not in KINDS]
        if self.prompts == "suite" and (unknown or not self.kinds):
            raise DepthcurseError(f"--kinds {','.join(self.kinds) or '(none)'}: use {', '.join(KINDS)}")
        if self.per_kind < 1:
            raise DepthcurseError(f"--per-kind must be at least 1, got {self.per_kind}")
        if self.draft_tokens < 1:
            raise DepthcurseError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")
        if self.draft_length not in POLICIES:
            raise DepthcurseError(f"unknown --draft-length {self.draft_length!r}: use {', '.join(POLICIES)}")
        if self.max_new_tokens < 2:
            raise DepthcurseError(f"--max-new-tokens must be at least 2 (the first token is the whole model's own), got {self.max_new_tokens}")
        if self.temperature < 0:
            raise DepthcurseError(f"--temperature must be 0 or more, got {self.temperature}")
        if self.ngram < 1:
            raise DepthcurseError(f"--ngram must be at least 1, got {self.ngram}")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise DepthcurseError(f"--baselines {','.join(self.baselines)}: {bad[0]!r} is not one ({', '.join(BASELINES)}; an assistant by --assistant)")
        if self.draft_tokens > self.max_new_tokens - 1:  # what a round can ever use: the tokens left after the whole model's first
            return replace(self, draft_tokens=self.max_new_tokens - 1)
        return self

    def capped(self, asked: int) -> str | None:
        """The line that says --draft-tokens was capped (`asked` against what this config drafts), or None."""
        if asked <= self.draft_tokens:
            return None
        return (f"--draft-tokens {asked}: capped at {self.draft_tokens}, the most a round can ever use with --max-new-tokens {self.max_new_tokens} "
                "(the first token is the whole model's own)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def identity(self) -> dict:
        """What a run is, as `speculate.json` keeps it: every field (`kept_state`)."""
        return identity_of(self)


def run_text_of(units) -> str:
    """Blocks as runs ("layers 12-15"), branches as they are written ("a3, m7")."""
    if units and isinstance(units[0], str):
        return ", ".join(units)
    return ", ".join(run_text(r) for r in runs_of(tuple(sorted(units))))


_BRANCH = re.compile(r"([am])(\d+)(?:-(\d+))?")


def parse_skip(spec: str, n_layers: int) -> tuple:
    """`--skip`: blocks (`12-15`, `3,7`, as `--layers` takes them) or branches (`a3,m7,a10-12`: block 3's
    attention, block 7's MLP, the attention of blocks 10 to 12), not both; each named once, and not
    every block or every branch."""
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not any(t[:1] in "am" for t in tokens):
        return tuple(parse_removal(spec, n_layers, "--skip"))
    units = []
    for token in tokens:
        found = _BRANCH.fullmatch(token)
        if found is None:
            raise DepthcurseError(f"--skip {spec}: {token!r} is not a branch (a3: block 3's attention, m3: its MLP, a3-5: a run); give blocks or branches, not both")
        kind, first, last = found.group(1), int(found.group(2)), int(found.group(3) or found.group(2))
        if not 0 <= first <= last < n_layers:
            raise DepthcurseError(f"--skip {spec}: {token} names a block outside 0-{n_layers - 1}")
        units += [f"{kind}{i}" for i in range(first, last + 1)]
    twice = sorted({u for u in units if units.count(u) > 1})
    if twice:
        raise DepthcurseError(f"--skip {spec} names {', '.join(twice)} more than once")
    if len(units) == 2 * n_layers:
        raise DepthcurseError(f"--skip {spec} skips every branch of the {n_layers} blocks: the draft would run none")
    return tuple(sorted(units, key=lambda u: (u[0], int(u[1:]))))


def eos_tokens(model, tokenizer) -> tuple[int, ...]:
    """What ends a generation, as `model.generate` reads it: the generation config's eos (one or
    several), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))


def same_tokenizer(a, b) -> str | None:
    """None where two tokenizers map every text to the same ids (the same vocabulary and specials),
    else what differs."""
    if a.get_vocab() != b.get_vocab():
        return f"their vocabularies differ ({len(a.get_vocab()):,} and {len(b.get_vocab()):,} entries)"
    if (a.bos_token_id, a.eos_token_id) != (b.bos_token_id, b.eos_token_id):
        return f"their BOS/EOS differ ({a.bos_token_id}/{a.eos_token_id} and {b.bos_token_id}/{b.eos_token_id})"
    return None


@dataclass
class Method:
    name: str
    what: str  # in words, for the table
    draft: Draft | None = None  # None: a reference (generate, plain) or transformers' own loop
    skipped: tuple[int, ...] = ()


def build_methods(model, cfg: SpeculateConfig, eos: tuple[int, ...], assistant=None, watch: Stopwatch | None = None) -> list[Method]:
    """The drafts measured, the self-draft first, then the baselines asked for."""
    n = num_layers(model)
    k = len(cfg.skip) if not isinstance(cfg.skip[0], str) else -(-len(cfg.skip) // 2)  # branches: as many blocks' worth
    methods = [Method("self-draft", f"the model without {run_text_of(cfg.skip)}", LayerSkipDraft(model, cfg.skip, "self-draft", watch=watch), cfg.skip)]
    for i, other in enumerate(cfg.also, start=2):  # other self-drafts, set against the first on the same prompts
        name = f"self-draft #{i}"
        methods.append(Method(name, f"the model without {run_text_of(other)}", LayerSkipDraft(model, tuple(other), name, watch=watch), tuple(other)))
    last = tuple(range(n - k, n))
    if "early-exit" in cfg.baselines and last != tuple(cfg.skip):
        methods.append(Method("early-exit", f"the model without its last {k} blocks ({run_text_of(last)})", LayerSkipDraft(model, last, "early-exit", watch=watch), last))
    if "prompt-lookup" in cfg.baselines:
        methods.append(Method("prompt-lookup", f"prompt lookup (n-grams up to {cfg.ngram})", PromptLookupDraft(cfg.ngram, eos)))
    if assistant is not None:
        methods.append(Method("assistant", f"the assistant {cfg.assistant}", LayerSkipDraft(assistant, (), "assistant", shares_weights=False, watch=watch)))
        methods.append(Method("transformers-assistant", f"transformers' assisted decoding with {cfg.assistant}"))
    return methods


def check_prompts(model, tokenizer, prompts: list[Prompt], cfg: SpeculateConfig) -> list[torch.Tensor]:
    """The prompts' token ids, each refused in one line where it and its new tokens outrun the model's positions."""
    most = max_positions(model)
    ids = []
    for i, prompt in enumerate(prompts):
        encoded = tokenizer(prompt.text, return_tensors="pt").input_ids
        if encoded.shape[1] == 0:
            raise DepthcurseError(f"prompt {i} ({prompt.source}) is empty")
        if most is not None and encoded.shape[1] + cfg.max_new_tokens > most:
            raise DepthcurseError(f"prompt {i} ({prompt.source}) holds {encoded.shape[1]:,} tokens: with --max-new-tokens {cfg.max_new_tokens} that is "
                                  f"more than the model's {most:,} positions")
        ids.append(encoded)
    return ids


def _generation_record(g: Generation) -> dict:
    out = {k: v for k, v in asdict(g).items() if k != "tokens"}
    out["generated"] = len(g.tokens)
    return out


def _compare(reference: list[int] | None, tokens: list[int]) -> dict:
    if reference is None:
        return {"tokens_equal": None}
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if first is None and len(reference) != len(tokens):
        first = min(len(reference), len(tokens))
    return {"tokens_equal": first is None, "first_difference": first}


def _hf_generate(model, ids, cfg: SpeculateConfig, eos: tuple[int, ...], seed: int, assistant=None) -> list[int]:
    """transformers' `model.generate` as the loops here decode: greedy, or sampling at the temperature
    alone (no top-k, no top-p), stopping at `eos` and nothing else. `generate` fills a field its
    config leaves unset from the model's own generation config, where an eos would stop it that
    `--ignore-eos` asked to pass: that field is set to `eos` while it runs."""
    from transformers import GenerationConfig  # lazy: with the model already loaded it is loaded too

    config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=not cfg.greedy, temperature=cfg.temperature or None, top_k=0 if not cfg.greedy else None,
                              top_p=1.0 if not cfg.greedy else None, eos_token_id=list(eos) or None, pad_token_id=eos[0] if eos else 0)
    if assistant is not None:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = cfg.draft_tokens, "constant", 0.0
    torch.manual_seed(seed)
    own = model.generation_config
    saved, own.eos_token_id = own.eos_token_id, list(eos) or None
    try:
        with torch.inference_mode():
            out = model.generate(ids, generation_config=config, **({"assistant_model": assistant} if assistant is not None else {}))
    finally:
        own.eos_token_id = saved
    return out[0, ids.shape[1]:].tolist()


def run_prompt(model, ids: torch.Tensor, index: int, methods: list[Method], cfg: SpeculateConfig, eos, watch: Stopwatch, assistant=None) -> dict:
    """One prompt: `generate`, `plain` and every method, in an order turned by `index`."""
    settings = DecodeSettings(cfg.max_new_tokens, eos if cfg.stop_at_eos else (), cfg.temperature, cfg.seed + index)
    order = ["generate", "plain", *(m.name for m in methods)]
    order = order[index % len(order):] + order[: index % len(order)]
    by_name = {m.name: m for m in methods}
    out: dict = {}
    for name in order:
        if name in ("generate", "transformers-assistant"):
            helper = assistant if name == "transformers-assistant" else None
            tokens, seconds = watch(lambda helper=helper: _hf_generate(model, ids, cfg, settings.eos, settings.seed, helper))
            out[name] = {"tokens": tokens, "seconds": seconds, "generated": len(tokens)}
        elif name == "plain":
            g = plain(model, ids, settings, watch)
            out[name] = {"tokens": g.tokens, **_generation_record(g)}
        else:
            g = speculative(model, by_name[name].draft, ids, settings, build_length(cfg.draft_length, cfg.draft_tokens), watch)
            out[name] = {"tokens": g.tokens, **_generation_record(g)}
    reference = out["generate"]["tokens"] if cfg.greedy else None
    for name, record in out.items():
        if name != "generate":
            record.update(_compare(reference, record["tokens"]))
    return out


def warm_up(model, ids: torch.Tensor, methods: list[Method], cfg: SpeculateConfig, eos, watch: Stopwatch, assistant=None) -> None:
    """Every method once on a few tokens, untimed: the first calls pay for allocation and kernel choice."""
    run_prompt(model, ids, 0, methods, replace(cfg, max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens)), eos, watch, assistant)


def run_speculate(loaded, cfg: SpeculateConfig, out_dir: Path, *, assistant=None, on_step: Callable[[str, int, int], None] | None = None,
                  world: World = World(), now: Callable[[], float] = time.perf_counter, on_note: Callable[[str], None] = lambda text: None) -> dict:
    """Every prompt of `cfg` (those `speculate.json` does not hold yet), and the summary; after the
    first prompt, `on_note` hears how long the rest will take (kept in the record beside the time)."""
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    cfg = cfg.checked(num_layers(model))
    if assistant is not None:
        why = same_tokenizer(tokenizer, assistant.tokenizer)
        if why is not None:
            raise DepthcurseError(f"--assistant {cfg.assistant} has another tokenizer than {loaded.name}: {why}; an assistant must share it")
    prompts = load_prompts(cfg.prompts, cfg.per_kind, cfg.kinds)
    ids = [p.to(loaded.device) for p in check_prompts(model, tokenizer, prompts, cfg)]
    eos = eos_tokens(model, tokenizer)
    out_dir = ensure_out_dir(out_dir)
    run = {**{k: v for k, v in loaded.describe().items() if k != "device"}, **cfg.identity(), "n_layers": num_layers(model),
           "prompts_sha256": tensors_digest(*ids)}  # the prompts' tokens: another file under the same name is another run
    path = out_dir / SPECULATE_JSON
    record = world.broadcast(json.loads(path.read_text()) if world.main and path.exists() else {})
    if record:
        refuse_other_run(out_dir, record["run"], run, what="speculate run")
    record = {"run": run, "prompts": {}, **{k: v for k, v in record.items() if k != "run"}}
    save = lambda: atomic_write(path, json_text(record)) if world.main else None  # noqa: E731
    watch = Stopwatch(loaded.device, now)
    methods = build_methods(model, cfg, eos, assistant.model if assistant is not None else None, watch)
    for method in methods:
        if method.draft is not None:
            method.draft.check()
    hf_assistant = assistant.model if assistant is not None else None
    todo = [i for i in range(len(prompts)) if str(i) not in record["prompts"]]
    started = now()
    rounds = [todo[r : r + world.size] for r in range(0, len(todo), world.size)]  # each round a prompt per rank
    say = on_note if world.main else (lambda t: None)
    forecast = Forecast("the prompts (each decoded alone, by generate and by every draft)", say=say, clock=now)
    if len(todo) < len(prompts):
        say(took_up("the prompts", len(prompts) - len(todo), len(prompts), path))
    with few_row_kernel(model) as record["check_linear"]:  # a check's few rows, each weight read once
        if todo:
            warm_up(model, ids[todo[0]], methods, cfg, eos, watch, hf_assistant)
        for r, batch in forecast.over(rounds):
            mine = batch[world.rank] if world.rank < len(batch) else None
            if on_step:
                on_step(f"prompt {batch[0] + 1} of {len(prompts)}", r * world.size, len(todo))
            result = None
            if mine is not None:
                result = {"kind": prompts[mine].kind, "source": prompts[mine].source, "prompt_tokens": ids[mine].shape[1],
                          **run_prompt(model, ids[mine], mine, methods, cfg, eos, watch, hf_assistant)}
            for i, done in zip(batch, world.all_gather(result)):
                record["prompts"][str(i)] = done
            save()
    record["methods"] = {m.name: {"what": m.what, "skipped": list(m.skipped), "shares_weights": bool(m.draft is not None and m.draft.shares_weights)}
                         for m in methods}
    record["complete"] = len(record["prompts"]) == len(prompts)
    record["asked"] = len(prompts)
    record["environment"] = environment()
    record["wall_time_s"] = round(record.get("wall_time_s", 0.0) + now() - started, 3)
    if todo:
        record["forecast"] = forecast.summary()
    record["summary"] = summarise(record)
    save()
    return record
