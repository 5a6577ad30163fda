"""`depthcurse speculate`: the model drafts for itself with blocks skipped, and the whole model checks
the draft, so that the output stays the whole model's. The draft's contract (`draft`), the built-in
drafts (`drafts`: blocks skipped, early exit, an assistant, prompt lookup), draft-length policies
(`lengths`), the decoding loops (`decoding`), the self-draft as transformers' `assistant_model`
(`assistant`), the prompts (`prompts`), what a draft can buy (`expected`), the run (`run`), its
figures (`summary`) and how they are shown (`report`)."""

from depthcurse.speculate.assistant import SelfDraftAssistant
from depthcurse.speculate.decoding import DecodeSettings, Generation, plain, speculative
from depthcurse.speculate.draft import Draft, Proposal, Sampler, Stopwatch
from depthcurse.speculate.drafts import LayerSkipDraft, PromptLookupDraft
from depthcurse.speculate.expected import acceptance_rate, break_even, ceiling, expected_speedup, expected_tokens
from depthcurse.speculate.lengths import POLICIES, build_length
from depthcurse.speculate.prompts import KINDS, Prompt, load_prompts
from depthcurse.speculate.report import kind_table, read_speculate, speculate_table, speculate_verdicts, write_speculate_files
from depthcurse.speculate.run import BASELINES, SPECULATE_JSON, SpeculateConfig, run_speculate

__all__ = ["SelfDraftAssistant", "DecodeSettings", "Generation", "plain", "speculative", "Draft", "Proposal", "Sampler", "Stopwatch", "LayerSkipDraft",
           "PromptLookupDraft", "acceptance_rate", "break_even", "ceiling", "expected_speedup", "expected_tokens", "POLICIES", "build_length", "KINDS",
           "Prompt", "load_prompts", "kind_table", "read_speculate", "speculate_table", "speculate_verdicts", "write_speculate_files", "BASELINES",
           "SPECULATE_JSON", "SpeculateConfig", "run_speculate"]
