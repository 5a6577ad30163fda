"""speculate: the model drafting for itself with blocks skipped.

- What a draft can buy (`expected`) against values worked out by hand, where the wrong formula
  (alpha^gamma for alpha^(gamma + 1), a check priced at one step where it costs more) gives another.
- Lossless: every draft's greedy output equals `model.generate`'s token for token (several skip
  sets, a draft whose skipped block does nothing, so that whole rounds are accepted and the bonus
  token is taken, every draft-length policy, prompt lookup, an assistant, and transformers' own
  assisted decoding with the self-draft as its `assistant_model`).
- Speculative sampling keeps the whole model's distribution: the rule exactly (accepting with
  min(1, p/q), else drawing from the residual, mixes back to p), and the whole loop by a chi-square
  test against the distribution worked out by enumerating the model's own probabilities; a loop
  with a wrong residual fails the same test.
- The draft shares every weight and keeps its own cache of the kept blocks, both cut back after each
  check; a run's figures against a record worked out by hand; bad input refused in one line; an
  interrupted run resumed; two torchrun ranks give one process's tokens.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from helpers import CORPUS, assert_one_line_error, table_cells, tiny_llama, torchrun
from depthcurse.speculate import (DecodeSettings, LayerSkipDraft, PromptLookupDraft, SelfDraftAssistant, Stopwatch, build_length, plain,
                                  speculative)
from depthcurse.speculate import decoding
from depthcurse.speculate.decoding import accept_greedy, accept_sampled, acceptance_probability, residual
from depthcurse.speculate.expected import (acceptance_rate, best_gamma, break_even, ceiling, expected_speedup, expected_tokens,
                                           largest_cost)
from depthcurse.speculate.lengths import Confidence, Heuristic, build_length
from depthcurse.speculate.summary import summarise

# fast on tiny models: `make mutate` runs these against each mutant, but those through the command line (conftest marks them `cli`)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.instruments]
WATCH = Stopwatch("cpu")


# --------------------------------------------------------------------------- what a draft can buy
@pytest.mark.statistics
def test_expected_tokens_speedup_and_ceiling_by_hand():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # alpha^(gamma+1) in the closed form: 1.875, not 1.75
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.6, 2.5) == pytest.approx((1 - 0.6**3.5) / 0.4)  # a mean draft length
    # Leviathan's example shape: alpha 0.8, gamma 4, c 0.5: E = 3.3616 tokens a round
    assert expected_speedup(0.8, 4, 0.5) == pytest.approx(3.3616 / 3.0)
    assert expected_speedup(0.8, 4, 0.5, verify=1.9) == pytest.approx(3.3616 / 3.9)  # a check of 5 tokens at 1.9 steps: it no longer pays
    assert ceiling(4, 0.5) == pytest.approx(5 / 3) and ceiling(4, 0.5, 1.9) == pytest.approx(5 / 3.9)
    with pytest.raises(ValueError, match=r"an acceptance rate lies in \[0, 1\], got 1.2"):
        expected_tokens(1.2, 3)
    with pytest.raises(ValueError, match="a draft length is 0 or more, got -1"):
        expected_tokens(0.5, -1)
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 0.5) == pytest.approx((1 - 0.5**1.5) / 0.5)


@pytest.mark.statistics
def test_break_even_is_the_root_of_one_plus_alpha_up_to_alpha_gamma_equal_to_gamma_c_plus_v():
    # gamma 4, c 0.25, v 1: 1 + a + a^2 + a^3 + a^4 = 2, i.e. a^4 + a^3 + a^2 + a - 1 = 0
    roots = np.roots([1, 1, 1, 1, -1])
    root = next(r.real for r in roots if abs(r.imag) < 1e-12 and 0 < r.real < 1)
    assert break_even(4, 0.25) == pytest.approx(root, abs=1e-12)
    # v 1.5: = 2.5
    roots = np.roots([1, 1, 1, 1, -1.5])
    assert break_even(4, 0.25, 1.5) == pytest.approx(next(r.real for r in roots if abs(r.imag) < 1e-12 and 0 < r.real < 1), abs=1e-12)
    assert break_even(4, 1.1) is None  # a draft dearer than the model never pays
    assert break_even(3, 0.0, 0.5) == 0.0  # free drafts and a check cheaper than a step pay at any acceptance
    assert break_even(3, 0.0, 1.0) == 0.0  # free drafts, a check of one step: even acceptance 0 breaks even, exactly
    assert break_even(4, 1.0) == pytest.approx(1.0, abs=1e-8)  # a draft as dear as the model: only every token accepted breaks even
    assert break_even(4, 0.5, 3.5) is None  # the ceiling at v = 3.5 is 5 / 5.5: nothing pays, though at v = 1 it would
    # free drafts, a check of 1.5 steps: 1 + a + a^2 + a^3 = 1.5 (at v = 1 acceptance 0 would already break even)
    roots = np.roots([1, 1, 1, -0.5])
    assert break_even(3, 0.0, 1.5) == pytest.approx(next(r.real for r in roots if abs(r.imag) < 1e-12 and 0 < r.real < 1), abs=1e-12)
    assert acceptance_rate(7, 3) == 0.7 and acceptance_rate(0, 0) is None
    assert largest_cost(0.5, 3) == pytest.approx((1.875 - 1) / 3) and largest_cost(0.5, 3, 2.0) == pytest.approx((1.875 - 2) / 3)
    assert largest_cost(0.5, 1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="a draft proposes at least one token, got gamma = 0"):
        largest_cost(0.5, 0)
    # E(g) / (0.1 g + 1) at alpha 0.8: 1.636, 2.033, 2.271, 2.401, 2.459, 2.470, 2.448, ...: gamma 6
    assert best_gamma(0.8, 0.1) == (6, pytest.approx((1 - 0.8**7) / 0.2 / 1.6))
    assert best_gamma(0.2, 0.9) == (1, pytest.approx(1.2 / 1.9))  # a poor draft: the shortest
    assert best_gamma(0.2, 0.9, 0.5) == (1, pytest.approx(1.2 / 1.4))  # never 0 tokens, though no draft at all (1 / 0.5) would be faster
    assert best_gamma(0.99, 0.01, most=3)[0] == 3 and best_gamma(0.999, 0.001)[0] == 64  # the longest considered: 64 by default
    assert best_gamma(0.8, 0.1, 3.0)[0] == 9  # a dearer check wants longer drafts: 1.1393, 1.1444, 1.1426 at 8, 9, 10 (6 at v = 1)
    assert best_gamma(0.5, 0.5, most=1) == (1, pytest.approx(1.5 / 1.5))
    assert best_gamma(0.0, 0.0, 1.25, most=8) == (1, pytest.approx(0.8))  # a free draft never accepted: every length ties; the shortest
    with pytest.raises(ValueError, match="the longest draft considered is at least 1, got 0"):
        best_gamma(0.5, 0.5, most=0)


# --------------------------------------------------------------------------- lossless
def _model_with_a_silent_block(seed: int = 3, vocab: int = 50):
    """A tiny Llama whose block 4 adds nothing (its output projections zero): skipping it changes no
    logit, so a draft without it is accepted whole, round after round (the bonus token's branch)."""
    model = tiny_llama(vocab, layers=6, seed=seed)
    with torch.no_grad():
        model.model.layers[4].self_attn.o_proj.weight.zero_()
        model.model.layers[4].mlp.down_proj.weight.zero_()
    return model


PROMPT = torch.tensor([[3, 4, 5, 6, 7, 8, 3, 4, 5]])


def _generate(model, n: int, eos=(1,)) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=list(eos) or None, pad_token_id=2)
    return model.generate(PROMPT, generation_config=config)[0, PROMPT.shape[1]:].tolist()


@pytest.mark.parametrize("policy", ["fixed", "confidence", "heuristic"])
def test_every_greedy_draft_gives_model_generate_token_for_token(policy):
    model = _model_with_a_silent_block()
    for eos in ((1,), ()) if policy == "fixed" else ((1,),):  # past an eos: one policy is enough
        reference = _generate(model, 40, eos)
        settings = DecodeSettings(max_new_tokens=40, eos=eos)
        assert plain(model, PROMPT, settings, WATCH).tokens == reference
        for skip in [(4,), (2, 4), (5,), (0, 1, 2, 3, 4)]:
            g = speculative(model, LayerSkipDraft(model, skip), PROMPT, settings, build_length(policy, 3), WATCH)
            assert g.tokens == reference, (skip, policy, eos)
        g = speculative(model, PromptLookupDraft(2, eos), PROMPT, settings, build_length(policy, 3), WATCH)
        assert g.tokens == reference
    assistant = tiny_llama(50, layers=2, seed=9)
    g = speculative(model, LayerSkipDraft(assistant, (), "assistant", shares_weights=False), PROMPT, DecodeSettings(40, (1,)), build_length(policy, 3), WATCH)
    assert g.tokens == _generate(model, 40)


def test_a_draft_that_changes_nothing_is_accepted_whole_and_the_bonus_token_taken():
    model = _model_with_a_silent_block()
    g = speculative(model, LayerSkipDraft(model, (4,)), PROMPT, DecodeSettings(max_new_tokens=31), build_length("fixed", 3), WATCH)
    assert g.rounds == [[3, 3]] * 7 + [[1, 1]]  # 1 + 7 x 4 = 29 tokens; with 2 to go, 1 drafted and the check's own
    assert g.steps == 8 and len(g.tokens) == 31
    # each round after a full acceptance feeds the draft's last token and the bonus in one pass, then
    # one token a pass: 3 passes (1 + 1 + 1 tokens) the first round, 3 (2 + 1 + 1) the next six, 1 (2) the last
    assert (g.draft_calls, g.draft_tokens_fed) == (22, 29)


def test_the_draft_shares_every_weight_and_keeps_a_cache_of_the_kept_blocks_cut_back_to_the_accepted_prefix():
    model = tiny_llama(50, layers=6, seed=3)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    seen = []

    class Recording(LayerSkipDraft):
        def propose(self, sequence, most, stop, sampler):
            seen.append(("cached", self.lm.length, sequence.shape[1]))
            # inside the draft's passes the model is the model without the skipped blocks: the same modules
            with self._skipping():
                blocks = list(model.model.layers)
                seen.append(("blocks", [id(b) for b in blocks]))
            return super().propose(sequence, most, stop, sampler)

        def agree(self, length):
            super().agree(length)
            seen.append(("agreed", self.lm.length, length))

    draft = Recording(model, (1, 3))
    g = speculative(model, draft, PROMPT, DecodeSettings(max_new_tokens=24), build_length("fixed", 4), WATCH)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # nothing copied, nothing moved
    kept = [id(model.model.layers[i]) for i in (0, 2, 4, 5)]
    assert all(entry[1] == kept for entry in seen if entry[0] == "blocks")
    assert len(model.model.layers) == 6 and model.config.num_hidden_layers == 6  # put back after every pass
    assert len(draft.lm.cache.layers) == 4  # the draft's KV cache holds its 4 blocks' keys and values
    assert g.draft_cache_bytes == pytest.approx(g.cache_bytes * 4 / 6, rel=0.2)
    # after each check the draft's cache holds no position past what still stands, and the next
    # proposal starts from there (what it lacks it feeds again)
    agreed = [e for e in seen if e[0] == "agreed"]
    assert agreed and all(cached <= length for _, cached, length in agreed)
    cached = [e for e in seen if e[0] == "cached"]
    assert all(c <= length - 1 for _, c, length in cached)


def test_the_draft_feeds_exactly_what_it_lacks_after_each_check():
    """After a round with a rejection the draft's cache holds the sequence it saw and the accepted part
    of its proposal, so the next round feeds one token (the correction); after a full acceptance its
    last proposed token was never fed, so two (it and the bonus). Each round then feeds its proposal
    but the last: the tokens fed are 1 + (m_1 - 1) + sum over later rounds of (1 or 2) + (m_r - 1).
    A cache cut one position short feeds one more after every rejection (issue 80)."""
    model = tiny_llama(50, layers=6, seed=3)
    seen = []

    class Recording(LayerSkipDraft):
        def agree(self, length):
            before = self.lm.length
            super().agree(length)
            seen.append((before, length, self.lm.length))

    g = speculative(model, Recording(model, (1, 3)), PROMPT, DecodeSettings(max_new_tokens=40), build_length("fixed", 4), WATCH)
    assert any(a < d for d, a in g.rounds) and any(a == d for d, a in g.rounds)  # both kinds of round
    pending = [1] + [1 if a < d else 2 for d, a in g.rounds[:-1]]
    assert g.draft_tokens_fed == sum(p + d - 1 for p, (d, _) in zip(pending, g.rounds))
    assert g.draft_calls == sum(d for d, _ in g.rounds)
    for (before, length, after), (d, a) in zip(seen, g.rounds):  # the cache after each check: no shorter than what stands and it had
        assert after == min(before, length)


def test_an_end_of_sequence_accepted_mid_round_ends_the_generation_and_counts_only_what_stands():
    """The draft changes nothing (its skipped block is silent): every proposal is accepted. The model's
    own token at position 1 or 2 made its end-of-sequence token: the check accepts the proposal past it,
    but the generation ends there, equal to `model.generate`'s, and the round counts the tokens through
    it, all accepted, not the proposal after it (issue 80)."""
    model = _model_with_a_silent_block()
    tokens = plain(model, PROMPT, DecodeSettings(max_new_tokens=6), WATCH).tokens
    i = next(i for i in (1, 2) if tokens[i] not in tokens[:i])
    eos = (tokens[i],)
    g = speculative(model, LayerSkipDraft(model, (4,)), PROMPT, DecodeSettings(max_new_tokens=20, eos=eos), build_length("fixed", 3), WATCH)
    assert g.tokens == tokens[: i + 1] == _generate(model, 20, eos)
    assert g.rounds == [[i, i]]  # drafted through the end, every one accepted: not [[3, 3]]


def test_prompt_lookup_tries_the_longest_ngram_first():
    """The last 2-gram (5, 6) first matches at 3, followed by 3; the last 1-gram (6) first matches at 1,
    followed by 2: the longest match decides."""
    ids = torch.tensor([[1, 6, 2, 5, 6, 3, 5, 6]])
    assert PromptLookupDraft(2).propose(ids, 2, None, None).tokens == [3, 5]
    assert PromptLookupDraft(1).propose(ids, 2, None, None).tokens == [2, 5]


def test_the_confidence_stop_reads_the_drafted_tokens_probability_and_the_policy_hears_what_was_drafted():
    """Under sampling the draft's confidence is its probability of the token it drew, not its largest
    probability; and the policy is told how many tokens a round proposed, not how many it might have."""
    model = tiny_llama(50, layers=6, seed=3)
    draft = LayerSkipDraft(model, (1, 3))
    draft.start(PROMPT)
    confidences = []
    sampler = DecodeSettings(temperature=1.5, seed=4).sampler()
    seen = torch.cat([PROMPT, torch.tensor([[7]])], dim=1)  # the prompt and the whole model's first token
    proposal = draft.propose(seen, 5, lambda c: confidences.append(c) or False, sampler)
    sequence = torch.cat([seen, torch.tensor([proposal.tokens])], dim=1)
    from depthcurse.surgery import removed_layers

    with torch.no_grad(), removed_layers(model, (1, 3)):
        probs = torch.softmax(model(input_ids=sequence).logits[0, seen.shape[1] - 1 :].float(), -1)
    mine = [float(probs[k, t]) for k, t in enumerate(proposal.tokens[:-1])]
    assert confidences == pytest.approx(mine, rel=1e-5)
    assert any(abs(c - float(probs[k].max())) > 1e-3 for k, c in enumerate(confidences))  # some drawn token was not the likeliest

    told = []

    class Told(Confidence):
        def update(self, accepted, drafted):
            told.append((drafted, accepted))
            super().update(accepted, drafted)

    g = speculative(model, LayerSkipDraft(model, (1, 3)), PROMPT, DecodeSettings(max_new_tokens=30), Told(max_draft=6, threshold=0.3), WATCH)
    assert told == [tuple(r) for r in g.rounds] and any(d < 6 for d, _ in g.rounds)  # rounds that stopped early: their own count


def test_the_confidence_policy_updates_every_nth_check_with_its_smoothing_by_hand():
    """every 2: the first check leaves everything; the second smooths its own rate 3/4 in at weight 1 - 0.3
    (matchness 0.3 x 0 + 0.7 x 0.75 = 0.525 < 0.9: the threshold towards 0.8 + 0.02, momentum 0.6)."""
    c = Confidence(max_draft=4, threshold=0.8, every=2, smoothing=0.3, target=0.9, step=0.02, momentum=0.6)
    c.update(1, 4)
    assert c.matchness == 0.0 and c.threshold == 0.8
    c.update(3, 4)
    assert c.matchness == pytest.approx(0.7 * 0.75) and c.threshold == pytest.approx(0.6 * 0.8 + 0.4 * 0.82)
    c.update(4, 4)
    assert c.matchness == pytest.approx(0.7 * 0.75)  # the third: no update again


def test_transformers_assistant_follows_the_schedule_it_was_given():
    """With a draft accepted whole, transformers' heuristic schedule asks 2, then 4, 6, 8 tokens; the
    constant one 2 every round."""
    model = _model_with_a_silent_block()
    asked = {}
    for schedule in ("constant", "heuristic"):
        assistant = SelfDraftAssistant(model, (4,), num_assistant_tokens=2, schedule=schedule)
        calls = asked.setdefault(schedule, [])
        inner = assistant.generate
        assistant.generate = lambda *a, inner=inner, calls=calls, **k: calls.append(k.get("max_new_tokens")) or inner(*a, **k)
        model.generate(PROMPT, do_sample=False, max_new_tokens=24, assistant_model=assistant, pad_token_id=2)
    assert set(asked["constant"]) == {2} and asked["heuristic"][:4] == [2, 4, 6, 8]


def test_accept_greedy_keeps_the_proposal_up_to_its_first_miss_then_the_model_s_choice():
    logits = torch.zeros(4, 10)
    for i, t in enumerate([5, 6, 7, 8]):
        logits[i, t] = 1.0
    assert accept_greedy(logits, [5, 6, 7]) == ([5, 6, 7, 8], 3)  # all accepted: the bonus
    assert accept_greedy(logits, [5, 9, 7]) == ([5, 6], 1)  # the correction where it missed
    assert accept_greedy(logits, [0, 6, 7]) == ([5], 0)
    assert accept_greedy(logits[:1], []) == ([5], 0)


def test_transformers_assisted_decoding_takes_the_self_draft_and_gives_generate_s_tokens():
    model = _model_with_a_silent_block()
    reference = model.generate(PROMPT, do_sample=False, max_new_tokens=30)
    for skip in ((4,), (2, 4), (0, 1, 2, 3, 4)):
        assistant = SelfDraftAssistant(model, skip, num_assistant_tokens=3)
        assert torch.equal(model.generate(PROMPT, do_sample=False, max_new_tokens=30, assistant_model=assistant), reference), skip
        assert len(model.model.layers) == 6
    heuristic = SelfDraftAssistant(model, "2,4", num_assistant_tokens=2, schedule="heuristic")
    assert torch.equal(model.generate(PROMPT, do_sample=False, max_new_tokens=30, assistant_model=heuristic), reference)


def test_prompt_lookup_copies_what_followed_the_first_earlier_match_of_the_last_ngram():
    draft = PromptLookupDraft(max_ngram=2, eos=(1,))
    seq = torch.tensor([[7, 8, 9, 10, 7, 8, 11, 12, 7, 8]])
    assert draft.propose(seq, 3, None, None).tokens == [9, 10, 7]  # the bigram 7 8 first matched at 0
    assert draft.propose(seq, 10, None, None).tokens == [9, 10, 7, 8, 11, 12, 7, 8]  # no further than the sequence
    assert draft.propose(torch.tensor([[5, 1, 6, 5]]), 3, None, None).tokens == []  # cut at its eos
    assert draft.propose(torch.tensor([[2, 3, 4]]), 3, None, None).tokens == []  # no match
    assert PromptLookupDraft(1).propose(torch.tensor([[2, 3, 4, 3]]), 2, None, None).tokens == [4, 3]


def test_draft_length_policies_move_as_their_authors_code_moves_them():
    h = Heuristic(5)
    h.update(5, 5)
    assert h.most() == 7
    h.update(2, 7)
    h.update(0, 6)
    assert h.most() == 5
    for _ in range(9):
        h.update(0, h.most())
    assert h.most() == 1
    c = Confidence()  # Draft & Verify's defaults: threshold 0.8, auto_parameters [1, 0.5, 0.9, 1e-2, 0.9]
    assert c.stop(0.79) and not c.stop(0.8)
    c.update(2, 4)  # matchness 0.5 * 0 + 0.5 * 0.5 = 0.25 < 0.9: threshold towards 0.81
    assert c.matchness == 0.25 and c.threshold == pytest.approx(0.9 * 0.8 + 0.1 * 0.81)
    c.update(8, 8)  # matchness 0.625 < 0.9: up again
    c.matchness = 0.95
    t = c.threshold
    c.update(3, 3)  # matchness 0.975 >= 0.9, stopped early (3 < 8): towards t - 0.01
    assert c.threshold == pytest.approx(0.9 * t + 0.1 * (t - 0.01))
    t = c.threshold
    c.update(8, 8)  # drafted the most: the threshold stays
    assert c.threshold == pytest.approx(t)


# --------------------------------------------------------------------------- sampling
def test_the_speculative_sampling_rule_mixes_back_to_the_model_s_distribution_exactly():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(7, generator=gen) * 2, -1).double()
        q = torch.softmax(torch.randn(7, generator=gen) * 2, -1).double()
        for draft in (q, None):
            mixed = torch.zeros(7, dtype=torch.float64)
            for x in range(7):
                chance = float(q[x]) if draft is not None else float(x == 3)
                if chance == 0:
                    continue
                a = acceptance_probability(p, draft, x)
                mixed[x] += chance * a
                mixed += chance * (1 - a) * residual(p, draft, x)
            assert torch.allclose(mixed, p, atol=1e-12)


def _exact_marginals(model, prompt: torch.Tensor, temperature: float, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """P(second token) and P(third token) of sampling at `temperature`, by enumerating every first and second token."""
    with torch.no_grad():
        def dist(ids):
            return torch.softmax(model(input_ids=ids).logits[0, -1].double() / temperature, -1)

        p1 = dist(prompt)
        second, third = np.zeros(vocab), np.zeros(vocab)
        for a in range(vocab):
            pa = dist(torch.cat([prompt, torch.tensor([[a]])], 1))
            second += float(p1[a]) * pa.numpy()
            for b in range(vocab):
                pb = dist(torch.cat([prompt, torch.tensor([[a, b]])], 1))
                third += float(p1[a]) * float(pa[b]) * pb.numpy()
    return second, third


def _chi_square_p(tokens: list[int], expected: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(expected))
    return scipy_stats.chisquare(counts, expected * len(tokens)).pvalue


def test_speculative_sampling_keeps_the_whole_model_s_distribution_and_a_wrong_rule_does_not(monkeypatch):
    vocab, temperature, n = 6, 1.5, 200
    model = tiny_llama(vocab, layers=4, seed=11)
    with torch.no_grad():  # sharper distributions than a fresh init's, so that a draft and the model differ
        model.lm_head.weight.mul_(30)
    prompt = torch.tensor([[0, 3, 4]])
    second, third = _exact_marginals(model, prompt, temperature, vocab)

    def sample(seed):
        g = speculative(model, LayerSkipDraft(model, (1, 2)), prompt, DecodeSettings(3, (), temperature, seed), build_length("fixed", 2), WATCH)
        return g.tokens

    draws = [sample(seed) for seed in range(n)]
    assert _chi_square_p([d[1] for d in draws], second) > 1e-3 and _chi_square_p([d[2] for d in draws], third) > 1e-3
    # the same test has the power to see a wrong rule: a rejection drawing from p instead of the residual
    monkeypatch.setattr(decoding, "residual", lambda p, q, token: p)
    wrong = [sample(seed) for seed in range(n)]
    assert min(_chi_square_p([d[1] for d in wrong], second), _chi_square_p([d[2] for d in wrong], third)) < 1e-3


# --------------------------------------------------------------------------- the figures, by hand
def _draft(rounds, decode_s, draft_s, draft_calls, steps, step_s, generated, equal=True):
    return {"rounds": rounds, "decode_s": decode_s, "draft_s": draft_s, "draft_calls": draft_calls, "steps": steps, "step_s": step_s,
            "generated": generated, "prefill_s": 0.1, "draft_prefill_s": 0.05, "draft_tokens_fed": draft_calls, "draft_cache_bytes": 60,
            "cache_bytes": 100, "tokens_equal": equal, "first_difference": None if equal else 3}


@pytest.mark.statistics
def test_summary_figures_against_a_record_worked_by_hand():
    prompts = {}
    ratios = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    alphas = []
    for i, r in enumerate(ratios):
        # plain: 20 steps of 0.01 s in 0.25 s of decoding; the draft: rounds of 4, accepting 4 and i % 4
        plain = {"decode_s": 0.25, "step_s": 0.2, "steps": 20, "generated": 21, "prefill_s": 0.1}
        rounds = [[4, 4], [4, i % 4]]
        alphas.append((4 + i % 4) / (4 + i % 4 + (1 if i % 4 < 4 else 0)))
        prompts[str(i)] = {"kind": "code" if i < 3 else "math", "source": "s", "prompt_tokens": 5, "plain": plain,
                           "generate": {"seconds": 0.4, "generated": 21, "tokens": []},
                           "self-draft": _draft(rounds, 0.25 * r, draft_s=0.006 * 8, draft_calls=8, steps=2, step_s=0.03, generated=21, equal=i != 5)}
    record = {"prompts": prompts, "methods": {"self-draft": {}}}
    s = summarise(record)["drafts"]["self-draft"]
    assert s["speedup"]["median"] == pytest.approx(1 / 0.65)  # the median of the six ratios is 0.65
    assert s["speedup"]["interval"] == pytest.approx([1 / 0.9, 1 / 0.4])  # six pairs: the extremes bound the median at 96.9%
    assert s["alpha"]["mean"] == pytest.approx(np.mean(alphas))
    half = scipy_stats.t.ppf(0.975, 5) * np.std(alphas, ddof=1) / math.sqrt(6)
    assert s["alpha"]["interval"] == pytest.approx([np.mean(alphas) - half, np.mean(alphas) + half])
    assert s["pooled_alpha"] == pytest.approx(sum(4 + i % 4 for i in range(6)) / sum(5 + i % 4 for i in range(6)))
    assert s["c"]["mean"] == pytest.approx(0.006 / 0.01) and s["v"]["mean"] == pytest.approx(0.015 / 0.01)
    assert s["tokens_per_check"]["mean"] == pytest.approx(10.0)  # 20 tokens after the first, in 2 checks
    assert s["gamma"]["mean"] == 4.0
    expected = [expected_speedup(a, 4, 0.6) for a in alphas]
    assert s["expected"]["mean"] == pytest.approx(np.mean(expected))
    assert s["expected_v"]["mean"] == pytest.approx(np.mean([expected_speedup(a, 4, 0.6, 1.5) for a in alphas]))
    assert s["ceiling"] == pytest.approx(5 / 3.4) and s["ceiling_v"] == pytest.approx(5 / 3.9)
    assert s["break_even_v"] == pytest.approx(break_even(4, 0.6, 1.5))
    assert s["largest_c"] == pytest.approx(largest_cost(np.mean(alphas), 4, 1.5))
    assert s["overhead"]["mean"] == pytest.approx(np.mean([1 - (0.048 + 0.03) / (0.25 * r) for r in ratios]))
    assert s["lossless"] == {"equal": 5, "compared": 6, "differ": [{"prompt": 5, "at": 3}]}
    assert s["draft_cache_share"] == pytest.approx(0.6)
    e2e = sorted((0.1 + 0.05 + 0.25 * r) / (0.1 + 0.25) for r in ratios)
    assert summarise(record)["drafts"]["self-draft"]["end_to_end"]["median"] == pytest.approx(1 / ((e2e[2] + e2e[3]) / 2))
    by_kind = summarise(record)["by_kind"]
    assert by_kind["code"]["self-draft"]["speedup"]["median"] == pytest.approx(1 / 0.5) and by_kind["math"]["self-draft"]["prompts"] == 3


@pytest.mark.statistics
def test_each_draft_against_the_first_self_draft_paired_over_prompts_by_hand():
    """Three prompts; the self-draft accepts 8/9, 7/8, 6/7, another 4/5, 4/5, 3/4 (each prompt's
    rate): their differences' mean and Student's t interval at 2 df, and the word it gives; a draft
    decoded on one prompt only has no interval and cannot tell."""
    plain = {"decode_s": 0.25, "step_s": 0.2, "steps": 20, "generated": 21, "prefill_s": 0.1}
    first = [[[4, 4], [4, 4], [4, 0]], [[4, 4], [4, 3]], [[4, 4], [4, 2]]]
    other = [[[4, 4], [4, 0]], [[4, 4], [4, 0]], [[4, 3]]]
    prompts = {str(i): {"kind": "code", "source": "s", "prompt_tokens": 5, "plain": plain,
                        "self-draft": _draft(first[i], 0.2, 0.01, 4, 2, 0.03, 21),
                        "self-draft #2": _draft(other[i], 0.2, 0.01, 4, 2, 0.03, 21),
                        "early-exit": _draft([[4, 1]], 0.2, 0.01, 4, 2, 0.03, 21 if i == 0 else 1)} for i in range(3)}
    versus = summarise({"prompts": prompts, "methods": {"self-draft": {}, "self-draft #2": {}, "early-exit": {}}})["versus"]
    mine, theirs = [8 / 9, 7 / 8, 6 / 7], [4 / 5, 4 / 5, 3 / 4]
    d = np.array(theirs) - np.array(mine)
    half = scipy_stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    assert versus["self-draft #2"]["difference"] == pytest.approx(d.mean()) and versus["self-draft #2"]["prompts"] == 3
    assert versus["self-draft #2"]["interval"] == pytest.approx([d.mean() - half, d.mean() + half])
    assert versus["self-draft #2"]["verdict"] == ("less" if d.mean() + half < 0 else "cannot tell") == "less"
    assert versus["early-exit"] == {"against": "self-draft", "difference": pytest.approx(1 / 2 - 8 / 9), "interval": None, "prompts": 1,
                                    "verdict": "cannot tell"}


# --------------------------------------------------------------------------- the command
@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n\n".join(CORPUS[:4]), encoding="utf-8")
    return path


def test_speculate_prints_the_table_says_lossless_and_resumes_a_cut_run(run_cli, tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "spec"
    args = ["speculate", tiny_model_dir, "--skip", "1,2", "--prompts", prompts_file, "--max-new-tokens", "12", "--out", out]
    code, stdout, err = run_cli(*args)
    assert code == 0, err
    assert "lossless: every draft's greedy output equals model.generate's, token for token, on every prompt (4 of 4)" in stdout
    assert "self-draft" in stdout and "early-exit" in stdout and "prompt-lookup" in stdout and "break-even" in stdout
    record = json.loads((out / "speculate.json").read_text())
    assert record["complete"] and set(record["prompts"]) == {"0", "1", "2", "3"}
    assert record["methods"]["early-exit"]["skipped"] == [2, 3] and record["methods"]["self-draft"]["shares_weights"]
    assert record["check_linear"].startswith("depthcurse's few-row kernel at 2-8 rows")  # the check's matmuls, by the kernel built here
    assert (out / "speculate.csv").exists() and (out / "speculate.png").exists()
    assert "early-exit against self-draft: " in " ".join(stdout.split()) and "acceptance, paired over 4 prompts, Student's t)" in " ".join(stdout.split())
    code, _, err = run_cli("report", out, "--out", tmp_path / "page.md")
    assert code == 0, err
    page = (tmp_path / "page.md").read_text()
    assert "## Drafting with the model's own depth" in page and "speculate_0.png" in page and "lossless: every draft's" in page
    for p in record["prompts"].values():
        assert p["plain"]["tokens"] == p["generate"]["tokens"] == p["self-draft"]["tokens"] == p["early-exit"]["tokens"]
    # an interrupted run: prompt 2 never finished; the rerun measures it alone and keeps the others as they were
    kept = record["prompts"]["1"]
    del record["prompts"]["2"]
    record["complete"] = False
    (out / "speculate.json").write_text(json.dumps(record))
    code, _, err = run_cli(*args)
    assert code == 0, err
    again = json.loads((out / "speculate.json").read_text())
    assert again["complete"] and again["prompts"]["1"] == kept and "2" in again["prompts"]


def test_other_self_drafts_run_on_the_same_prompts_and_are_set_against_the_first(run_cli, tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "spec"
    args = ["speculate", tiny_model_dir, "--skip", "1", "--also-skip", "2", "--also-skip", "a1,m3", "--prompts", prompts_file, "--max-new-tokens", "8",
            "--baselines", "none", "--out", out]
    code, stdout, err = run_cli(*args)
    assert code == 0, err
    record = json.loads((out / "speculate.json").read_text())
    assert record["methods"]["self-draft #2"]["skipped"] == [2] and record["methods"]["self-draft #3"]["skipped"] == ["a1", "m3"]
    assert record["run"]["also"] == [[2], ["a1", "m3"]]
    said = " ".join(stdout.split())
    assert "self-draft #2 against self-draft:" in said and "self-draft #3 against self-draft:" in said and "(4 of 4)" in said
    for p in record["prompts"].values():
        assert p["self-draft #2"]["tokens"] == p["self-draft #3"]["tokens"] == p["generate"]["tokens"]
    assert_one_line_error(*run_cli(*args[:4], "--also-skip", "1", "--prompts", prompts_file, "--out", tmp_path / "b"),
                          "--also-skip layer 1 is a self-draft named twice")
    assert_one_line_error(*run_cli(*args[:4], "--also-skip", "2", "--also-skip", "2", "--prompts", prompts_file, "--out", tmp_path / "c"),
                          "--also-skip layer 2 is a self-draft named twice")  # a draft twice among the others: measured once


@pytest.mark.parametrize("extra, match", [
    (["--skip", "0-3"], "--skip 0-3 removes all 4 layers"),
    (["--skip", "1", "--draft-tokens", "0"], "--draft-tokens must be at least 1"),
    (["--skip", "1", "--sample", "--temperature", "0"], "--sample with --temperature 0"),
    (["--skip", "7"], "layer 7 is out of range"),
    ([], "give the blocks the draft skips"),
    (["--skip", "1", "--draft-length", "wild"], "unknown --draft-length"),
    (["--skip", "1", "--baselines", "medusa"], "'medusa' is not one"),
    (["--skip-from", "no-such-select-run"], "--skip-from no-such-select-run: no select run there (select.json)"),
])
def test_bad_input_is_one_line_before_any_work(run_cli, tiny_model_dir, prompts_file, tmp_path, extra, match):
    code, out, err = run_cli("speculate", tiny_model_dir, "--prompts", prompts_file, "--out", tmp_path / "bad", *extra)
    assert_one_line_error(code, out, err, match)
    assert not (tmp_path / "bad" / "speculate.json").exists()


def test_an_assistant_of_another_tokenizer_and_a_prompt_past_the_model_s_positions_are_refused(run_cli, tiny_model_dir, prompts_file, tmp_path,
                                                                                             tiny_bert_tokenizer):
    other = tmp_path / "other"
    tiny_llama(len(tiny_bert_tokenizer), layers=2).save_pretrained(other)
    tiny_bert_tokenizer.save_pretrained(other)
    code, out, err = run_cli("speculate", tiny_model_dir, "--skip", "1", "--prompts", prompts_file, "--assistant", other, "--out", tmp_path / "a")
    assert_one_line_error(code, out, err, "has another tokenizer")
    long = tmp_path / "long.txt"
    long.write_text(" ".join(CORPUS * 20), encoding="utf-8")
    code, out, err = run_cli("speculate", tiny_model_dir, "--skip", "1", "--prompts", long, "--out", tmp_path / "b")
    assert_one_line_error(code, out, err, "more than the model's 256 positions")


def test_an_assistant_of_the_same_tokenizer_drafts_here_and_in_transformers_loop(run_cli, tiny_model_dir, prompts_file, tmp_path, tiny_tokenizer):
    helper = tmp_path / "helper"
    tiny_llama(len(tiny_tokenizer), layers=2, seed=5).save_pretrained(helper)
    tiny_tokenizer.save_pretrained(helper)
    out = tmp_path / "with-assistant"
    code, stdout, err = run_cli("speculate", tiny_model_dir, "--skip", "1", "--prompts", prompts_file, "--assistant", helper, "--baselines", "none",
                                "--max-new-tokens", "10", "--out", out)
    assert code == 0, err
    record = json.loads((out / "speculate.json").read_text())
    assert set(record["methods"]) == {"self-draft", "assistant", "transformers-assistant"}
    assert not record["methods"]["assistant"]["shares_weights"]
    for p in record["prompts"].values():
        assert p["assistant"]["tokens_equal"] and p["transformers-assistant"]["tokens_equal"]
    assert record["summary"]["transformers-assistant"]["lossless"]["equal"] == 4


def test_sampling_runs_say_what_they_keep(run_cli, tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "sampled"
    code, stdout, err = run_cli("speculate", tiny_model_dir, "--skip", "2", "--prompts", prompts_file, "--sample", "--temperature", "0.7",
                                "--draft-length", "heuristic", "--baselines", "prompt-lookup", "--ignore-eos", "--max-new-tokens", "9", "--seed", "5",
                                "--out", out)
    assert code == 0, err
    assert "sampling at temperature 0.7" in stdout
    record = json.loads((out / "speculate.json").read_text())
    assert record["run"]["temperature"] == 0.7 and record["run"]["seed"] == 5 and not record["run"]["stop_at_eos"]
    assert all(p["self-draft"]["generated"] == 9 for p in record["prompts"].values())  # past any eos
    assert all(p["self-draft"]["tokens_equal"] is None for p in record["prompts"].values())


def test_two_ranks_share_the_prompts_and_give_one_process_s_tokens(run_cli, tiny_model_dir, prompts_file, tmp_path):
    common = ["speculate", tiny_model_dir, "--skip", "1,2", "--prompts", prompts_file, "--max-new-tokens", "10", "--baselines", "prompt-lookup"]
    code, _, err = run_cli(*map(str, common), "--out", str(tmp_path / "one"))
    assert code == 0, err
    two = torchrun("-m", "depthcurse", *common, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    one, both = (json.loads((tmp_path / d / "speculate.json").read_text()) for d in ("one", "two"))
    for i, p in one["prompts"].items():
        for name in ("generate", "plain", "self-draft", "prompt-lookup"):
            assert both["prompts"][i][name]["tokens"] == p[name]["tokens"]
        assert both["prompts"][i]["self-draft"]["rounds"] == p["self-draft"]["rounds"]
    assert (two.stdout + two.stderr).count("written: ") == 1


def test_ignore_eos_decodes_past_it_and_generate_s_reference_does_too():
    from depthcurse.speculate.run import SpeculateConfig, build_methods, run_prompt

    model = _model_with_a_silent_block()
    first = plain(model, PROMPT, DecodeSettings(max_new_tokens=1), WATCH).tokens[0]
    model.generation_config.eos_token_id = first  # the model's own eos: the very first token it picks
    cfg = SpeculateConfig(skip=(4,), max_new_tokens=12, stop_at_eos=False, baselines=("prompt-lookup",)).checked(6)
    out = run_prompt(model, PROMPT, 0, build_methods(model, cfg, (first,)), cfg, (first,), WATCH)
    assert len(out["generate"]["tokens"]) == 12 and out["generate"]["tokens"][0] == first
    assert all(out[name]["tokens_equal"] for name in ("plain", "self-draft", "prompt-lookup"))
    stopping = SpeculateConfig(skip=(4,), max_new_tokens=12, baselines=()).checked(6)
    out = run_prompt(model, PROMPT, 1, build_methods(model, stopping, (first,)), stopping, (first,), WATCH)
    assert out["generate"]["tokens"] == out["self-draft"]["tokens"] == [first]  # stopped by it


def _figures(**kw):
    base = {"prefill_s": 0.2, "draft_prefill_s": 0.0, "draft_tokens_fed": 0, "draft_cache_bytes": 0, "cache_bytes": 50, "tokens_equal": True,
            "first_difference": None, "rounds": [], "draft_calls": 0, "draft_s": 0.0}
    return {**base, **kw}


def _three_prompts() -> dict:
    """Three prompts: a code one, a math one, and a math one that ends at its first token (nothing decoded)."""
    return {"methods": {"self-draft": {}, "prompt-lookup": {}, "transformers-assistant": {}}, "prompts": {
        "0": {"kind": "code", "generate": {"seconds": 1.0, "generated": 5}, "transformers-assistant": {"seconds": 0.5, "generated": 5, "tokens_equal": True},
              "plain": _figures(decode_s=0.8, step_s=0.6, steps=4, generated=5),
              "self-draft": _figures(rounds=[[2, 2], [2, 0]], decode_s=0.5, draft_s=0.2, draft_calls=4, steps=2, step_s=0.25, generated=5,
                                     draft_prefill_s=0.1, draft_cache_bytes=30),
              "prompt-lookup": _figures(rounds=[[3, 1]], decode_s=0.6, steps=3, step_s=0.45, generated=5, tokens_equal=False, first_difference=2)},
        "1": {"kind": "math", "generate": {"seconds": 2.0, "generated": 9}, "transformers-assistant": {"seconds": 1.6, "generated": 9, "tokens_equal": True},
              "plain": _figures(decode_s=1.6, step_s=1.2, steps=8, generated=9, prefill_s=0.4),
              "self-draft": _figures(rounds=[[2, 2], [2, 2], [2, 1]], decode_s=1.0, draft_s=0.3, draft_calls=6, steps=3, step_s=0.6, generated=9,
                                     prefill_s=0.4, draft_prefill_s=0.2, draft_cache_bytes=60, cache_bytes=100),
              "prompt-lookup": _figures(decode_s=1.7, steps=8, step_s=1.3, generated=9, prefill_s=0.4, cache_bytes=100)},
        "2": {"kind": "math", "generate": {"seconds": 0.3, "generated": 1}, "transformers-assistant": {"seconds": 0.3, "generated": 1, "tokens_equal": True},
              "plain": _figures(decode_s=1e-5, step_s=0.0, steps=0, generated=1, prefill_s=0.1),  # the loop's exit, timed: not decoding
              "self-draft": _figures(decode_s=0.0, steps=0, step_s=0.0, generated=1),
              "prompt-lookup": _figures(decode_s=0.0, steps=0, step_s=0.0, generated=1)}}}


def _est(values):
    from depthcurse.stats import mean_interval

    return {"mean": pytest.approx(float(np.mean(values))), "interval": pytest.approx(mean_interval(values)) if len(values) > 1 else None, "n": len(values)}


@pytest.mark.statistics
def test_summary_keeps_every_figure_by_name_on_prompts_with_every_edge():
    """Every figure of a three-prompt record worked out by hand: a prompt that decodes nothing is left
    out of the timings, a round-less draft has no acceptance, prompt lookup's c is 0, transformers'
    loop and ours are timed whole against generate's, and each kind on its own."""
    got = summarise(_three_prompts())
    # self-draft: prompt 0 accepts 2 with 1 rejection, prompt 1 accepts 5 with 1; plain's step is 0.15 s on both
    alphas, cs, vs = [2 / 3, 5 / 6], [1 / 3, 1 / 3], [5 / 6, 4 / 3]
    e = [sum(a**i for i in range(3)) for a in alphas]  # 19/9 and 91/36 tokens a round at gamma 2
    expected = [e[0] / (2 / 3 + 1), e[1] / (2 / 3 + 1)]
    expected_v = [e[0] / (2 / 3 + 5 / 6), e[1] / (2 / 3 + 4 / 3)]
    v = float(np.mean(vs))
    self_draft = {
        "alpha": _est(alphas), "c": _est(cs), "v": _est(vs), "gamma": _est([2.0, 2.0]), "tokens_per_check": _est([2.0, 8 / 3]),
        "expected": _est(expected), "expected_v": _est(expected_v), "overhead": _est([0.1, 0.1]), "tokens_per_s": _est([8.0, 8.0]),
        "pooled_alpha": pytest.approx(7 / 9), "speedup": {"median": pytest.approx(1.6), "interval": None, "pairs": 2},
        "end_to_end": {"median": pytest.approx(1.25), "interval": None, "pairs": 2}, "prompts": 2,
        "ceiling": pytest.approx(3 / (2 / 3 + 1)), "break_even": pytest.approx(break_even(2, 1 / 3)), "ceiling_v": pytest.approx(3 / (2 / 3 + v)),
        "break_even_v": pytest.approx(break_even(2, 1 / 3, v)), "largest_c": pytest.approx((1 + 0.75 + 0.5625 - v) / 2),
        "best_gamma": {"gamma": best_gamma(0.75, 1 / 3, v)[0], "speedup": pytest.approx(best_gamma(0.75, 1 / 3, v)[1])},
        "measured_over_expected": pytest.approx(1.6 / np.mean(expected_v)),
        "lossless": {"equal": 3, "compared": 3, "differ": []}, "draft_cache_bytes": 60, "draft_cache_share": pytest.approx(0.6)}
    assert got["drafts"]["self-draft"] == self_draft
    # prompt lookup: no forward pass (c = 0); prompt 1 proposed nothing (no acceptance, no draft length)
    v = (1.0 + (1.3 / 8) / 0.15) / 2
    lookup = {
        "alpha": _est([0.5]), "c": _est([0.0, 0.0]), "v": _est([1.0, (1.3 / 8) / 0.15]), "gamma": _est([3.0]), "tokens_per_check": _est([4 / 3, 1.0]),
        "expected": _est([1.875]), "expected_v": _est([1.875]), "overhead": _est([0.25, 1 - 1.3 / 1.7]), "tokens_per_s": _est([4 / 0.6, 8 / 1.7]),
        "pooled_alpha": 0.5, "speedup": {"median": pytest.approx(1 / ((0.75 + 1.7 / 1.6) / 2)), "interval": None, "pairs": 2},
        "end_to_end": {"median": pytest.approx(1 / ((0.8 + 2.1 / 2.0) / 2)), "interval": None, "pairs": 2}, "prompts": 2,
        "ceiling": pytest.approx(4.0), "break_even": 0.0, "ceiling_v": pytest.approx(4 / v), "break_even_v": pytest.approx(break_even(3, 0.0, v)),
        "largest_c": pytest.approx((1.875 - v) / 3),
        "best_gamma": {"gamma": best_gamma(0.5, 0.0, v)[0], "speedup": pytest.approx(best_gamma(0.5, 0.0, v)[1])},
        "measured_over_expected": pytest.approx(1 / ((0.75 + 1.7 / 1.6) / 2) / 1.875),
        "lossless": {"equal": 2, "compared": 3, "differ": [{"prompt": 0, "at": 2}]}, "draft_cache_bytes": 0, "draft_cache_share": 0.0}
    assert got["drafts"]["prompt-lookup"] == lookup
    assert got["plain"] == {"tokens_per_s": _est([5.0, 5.0]), "overhead": _est([0.25, 0.25]), "prompts": 3,
                            "speedup": {"median": pytest.approx(1.0), "interval": None, "pairs": 3}, "lossless": {"equal": 3, "compared": 3, "differ": []}}
    assert got["transformers-assistant"] == {"speedup": {"median": pytest.approx(1 / 0.8), "interval": None, "pairs": 3}, "prompts": 3,
                                             "lossless": {"equal": 3, "compared": 3, "differ": []}}
    assert set(got) == {"drafts", "versus", "plain", "timing", "transformers-assistant", "by_kind"} and list(got["drafts"]) == ["self-draft", "prompt-lookup"]
    assert got["timing"] == {"status": "unstable", "reason": "3 pairs give no 95% interval (at least 6 do)", "prompts": 3}
    kept = ("alpha", "pooled_alpha", "tokens_per_check", "speedup", "expected_v", "prompts", "lossless")
    assert got["by_kind"]["code"]["self-draft"] == {k: self_draft[k] for k in ("pooled_alpha",)} | {
        "alpha": _est([2 / 3]), "tokens_per_check": _est([2.0]), "speedup": {"median": pytest.approx(1.6), "interval": None, "pairs": 1},
        "expected_v": _est([expected_v[0]]), "prompts": 1, "lossless": {"equal": 1, "compared": 1, "differ": []}} | {"pooled_alpha": pytest.approx(2 / 3)}
    assert got["by_kind"]["math"]["prompt-lookup"] == {"alpha": None, "pooled_alpha": None, "tokens_per_check": _est([1.0]), "expected_v": None,
                                                       "speedup": {"median": pytest.approx(1.6 / 1.7), "interval": None, "pairs": 1}, "prompts": 1,
                                                       "lossless": {"equal": 2, "compared": 2, "differ": []}}
    assert set(got["by_kind"]) == {"code", "math"} and all(set(by[name]) == set(kept) for by in got["by_kind"].values() for name in by)
    # prompts are read in their numbers' order, not the text's ("10" after "9")
    record = _three_prompts()
    record["prompts"] = {str(10 - int(i)): p for i, p in record["prompts"].items()}
    record["prompts"]["8"]["prompt-lookup"].update(tokens_equal=False, first_difference=0)
    assert summarise(record)["drafts"]["prompt-lookup"]["lossless"]["differ"] == [{"prompt": 8, "at": 0}, {"prompt": 10, "at": 2}]


@pytest.mark.statistics
def test_a_prompt_that_decodes_one_token_is_timed():
    record = {"methods": {"self-draft": {}}, "prompts": {"0": {
        "kind": "code", "generate": {"seconds": 0.2, "generated": 2},
        "plain": _figures(decode_s=0.1, step_s=0.09, steps=1, generated=2),
        "self-draft": _figures(rounds=[[1, 1]], decode_s=0.2, draft_s=0.05, draft_calls=1, steps=1, step_s=0.1, generated=2)}}}
    got = summarise(record)
    assert got["drafts"]["self-draft"]["prompts"] == 1 and got["drafts"]["self-draft"]["speedup"]["median"] == pytest.approx(0.5)
    assert got["plain"]["tokens_per_s"]["mean"] == pytest.approx(10.0) and got["plain"]["overhead"]["mean"] == pytest.approx(0.1)


@pytest.mark.statistics
def test_the_verdict_lines_say_lossless_only_of_every_draft_and_pays_only_above_the_lower_end():
    """Two drafts, one whose output differs on a prompt: no "lossless: every draft's" line, and a line
    naming the other. A speedup of 1.20x (0.95-1.40) cannot be told from decoding alone, (1.05-1.40)
    pays, (0.70-0.98) does not pay: the interval's lower end decides that it pays, its upper end that it
    does not (issue 80)."""
    from depthcurse.speculate.report import speculate_verdicts

    def draft(equal, interval):
        return {"lossless": {"equal": equal, "compared": 2, "differ": [] if equal == 2 else [{"prompt": 1, "at": 4}]},
                "speedup": {"median": 1.2, "interval": interval, "pairs": 6}, "alpha": {"mean": 0.7}}

    def lines(a, b):
        return speculate_verdicts({"run": {"temperature": 0}, "summary": {"drafts": {"self-draft": a, "early-exit": b}, "plain": {}}})

    said = lines(draft(2, [0.95, 1.4]), draft(1, [1.05, 1.4]))
    assert not any(line.startswith("lossless: every draft's") for line in said)
    assert "early-exit: greedy output differs from model.generate's on 1 of 2 prompts (prompt 1 at token 4)" in said
    assert "self-draft cannot be told from decoding alone (1.20x (0.95-1.40) measured)" in said
    assert "early-exit pays (1.20x (1.05-1.40) measured)" in said
    said = lines(draft(2, [0.7, 0.98]), draft(2, [0.9, 1.1]))
    assert "lossless: every draft's greedy output equals model.generate's, token for token, on every prompt (2 of 2)" in said
    assert "self-draft does not pay (1.20x (0.70-0.98) measured)" in said and "early-exit cannot be told from decoding alone (1.20x (0.90-1.10) measured)" in said


def test_a_prompts_file_keeps_its_text_exactly_where_its_format_can(tmp_path):
    """A .jsonl prompt ending in "assistant\\n" keeps its newline (and a leading one); a .txt's prompts,
    parted by blank lines, are trimmed of theirs, as its help says (issue 80)."""
    from depthcurse.speculate.prompts import from_file

    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"text": chat}) + "\n" + json.dumps({"text": "\nleading"}) + "\n")
    assert [p.text for p in from_file(str(jsonl))] == [chat, "\nleading"]
    txt = tmp_path / "p.txt"
    txt.write_text(chat + "\n\nsecond prompt\n")
    assert [p.text for p in from_file(str(txt))] == [chat.rstrip("\n"), "second prompt"]


@pytest.mark.statistics
def test_one_prompts_figure_prints_as_one_number_with_no_interval():
    """One prompt: a mean with no interval is said to have none, not printed bare; a range of one draft's
    check cost is one number, not "2.77-2.77" (issue 80)."""
    from depthcurse.speculate.report import _est, _span

    assert _est({"mean": 2.77, "interval": None, "n": 1}) == "2.77 (no interval)"
    assert _est({"mean": 2.77, "interval": [2.5, 3.0], "n": 4}) == "2.77 (2.50-3.00)"
    assert _span([2.77]) == "2.77" and _span([2.771, 2.774]) == "2.77" and _span([1.5, 2.77]) == "1.50-2.77"


@pytest.mark.statistics
def test_timings_on_an_unsteady_machine_are_said_untrusted_and_the_verdicts_speak_of_acceptance_alone():
    """Six prompts, the self-draft at 1.67x (0.48 s against 0.8). The control (this loop's whole-model decoding over
    model.generate's, the same tokens) at 1.00-1.02 on every prompt: ok, and the usual lines. The same
    with model.generate's time swinging 0.5-2x from prompt to prompt (a busy machine): speed's rule says
    unstable; the table says so in its title, the first line says why, and no line says what pays or
    what a check costs (issue 80)."""
    from depthcurse.speculate.report import speculate_table, speculate_verdicts

    def record(generate_seconds):
        prompts = {}
        for i, g in enumerate(generate_seconds):
            plain = _figures(decode_s=0.8, step_s=0.6, steps=8, generated=9)
            prompts[str(i)] = {"kind": "code", "source": "s", "prompt_tokens": 5, "generate": {"seconds": g, "generated": 9}, "plain": plain,
                               "self-draft": _figures(rounds=[[4, 3], [4, 4]], decode_s=0.48, draft_s=0.2, draft_calls=8, steps=2, step_s=0.3, generated=9)}
        out = {"prompts": prompts, "methods": {"self-draft": {"what": "the model without layer 1"}}, "asked": len(prompts), "complete": True,
               "run": {"temperature": 0, "model": "m", "max_new_tokens": 9, "draft_length": "fixed", "draft_tokens": 4}}
        out["summary"] = summarise(out)
        return out

    steady = record([1.0, 1.01, 0.99, 1.0, 1.02, 0.995])
    assert steady["summary"]["timing"]["status"] == "ok" and steady["summary"]["timing"]["prompts"] == 6
    lines = speculate_verdicts(steady)
    assert any(line.startswith("self-draft pays (1.67x") for line in lines) and any("decoding steps (v;" in line for line in lines)
    busy = record([0.5, 2.0, 1.0, 0.6, 1.8, 1.3])
    timing = busy["summary"]["timing"]
    assert timing["status"] == "unstable" and timing["reason"].endswith("(more than +-5%) over 6 pairs")
    lines = speculate_verdicts(busy)
    assert lines[1].startswith("the timings cannot be trusted here: the whole model's decoding, timed twice a prompt (this loop and model.generate, "
                               "the same tokens in turns), gave ")
    assert "self-draft: acceptance 0.88 (0.88-0.88) over 6 prompts (what pays: not said, the timings are not trusted)" in lines
    assert not any("pay (" in line or "pays (" in line or "decoding steps (v;" in line for line in lines)
    assert speculate_table(busy).title.endswith(": TIMINGS NOT TRUSTED, see the verdicts")
    breakeven = lambda r: table_cells(speculate_table(r))[1][10]  # noqa: E731  (the self-draft's row; issue 88: no cell says what pays where the verdict does not)
    assert breakeven(busy) == "not said: timings not trusted" and breakeven(steady) != breakeven(busy) and "pays" not in " ".join(map(str, table_cells(speculate_table(busy))))
    assert record([1.0, 1.0])["summary"]["timing"]["reason"] == "2 pairs give no 95% interval (at least 6 do)"


def _reported_record(status: str | None = None) -> dict:
    """`_three_prompts` as a finished run: what each draft is, the run's settings, its summary."""
    record = _three_prompts()
    for p in record["prompts"].values():
        p.update(source="s", prompt_tokens=5)
    record["methods"] = {"self-draft": {"what": "without layers 2-3"}, "prompt-lookup": {"what": "3-grams"},
                         "transformers-assistant": {"what": "the self-draft"}}
    record.update(asked=4, complete=False, run={"temperature": 0, "model": "tiny", "max_new_tokens": 8, "draft_length": "confidence", "draft_tokens": 2})
    record["summary"] = summarise(record)
    if status:
        record["summary"]["timing"] = {"status": status}
    return record


@pytest.mark.statistics
def test_the_table_and_every_line_print_the_figures_worked_by_hand():
    """`_three_prompts`' figures (worked out by hand in the test above) as the command prints them: the
    title with the run's settings and its untrusted timings, the caption (rich once ate its
    "E[tokens]" as markup), every cell, the kinds' table, both sets of verdict lines and the CSV's rows."""
    from depthcurse.speculate.report import kind_table, prompt_rows, speculate_table, speculate_verdicts

    table = speculate_table(_reported_record())
    assert table.title == ("tiny: drafts checked by the whole model (greedy), 3 of 4 prompts (incomplete), 8 new tokens at most; draft length at most 2, "
                           "confidence stop: TIMINGS NOT TRUSTED, see the verdicts")
    assert table.caption == (
        "95% intervals over prompts (Student's t; speedups: the median of per-prompt time ratios, distribution-free). c: a draft step's seconds, v: a "
        "check's, in decoding steps of the whole model alone. Expected: Leviathan et al.'s E\\[tokens] / (gamma c + v) at v = 1 and at the measured v. "
        "Ceiling: every token accepted. Break-even: the acceptance the draft pays at.")
    assert [c.header for c in table.columns] == [
        "draft", "tokens/s (decoding)", "speedup (decoding)", "speedup (with prefills)", "acceptance", "tokens per check", "c", "v",
        "expected: v = 1 | measured v", "ceiling: v = 1 | v", "break-even acceptance: v = 1 | v", "same tokens as generate"]
    assert table_cells(table) == [
        ["decoding alone: the whole model, a token a pass", "5.0 (5.0-5.0)", "1", "1", "", "1", "", "1", "", "", "", "3 of 3"],
        ["self-draft: without layers 2-3", "8.0 (8.0-8.0)", "1.60x (no interval)", "1.25x (no interval)", "0.75 (-0.31-1.81)", "2.33 (-1.90-6.57)",
         "0.33 (0.33-0.33)", "1.08 (-2.09-4.26)", "1.39 (-0.20-2.98) | 1.34 (0.42-2.25)", "1.80x | 1.71x", "not said: timings not trusted", "3 of 3"],
        ["prompt-lookup: 3-grams", "5.7 (-6.8-18.1)", "1.10x (no interval)", "1.08x (no interval)", "0.50 (no interval)", "1.17 (-0.95-3.28)",
         "0.00 (0.00-0.00)", "1.04 (0.51-1.57)", "1.88 (no interval) | 1.88 (no interval)", "4.00x | 3.84x", "not said: timings not trusted", "2 of 3"],
        ["transformers-assistant: the self-draft (against model.generate)", "", "", "1.25x (no interval)", "", "", "", "", "", "", "", "3 of 3"]]
    assert speculate_table(_reported_record("ok")).title.endswith("draft length at most 2, confidence stop")
    assert [row[10] for row in table_cells(speculate_table(_reported_record("ok")))] == ["", "0.46 | 0.50", "0.00 | 0.04", ""]  # trusted: the break-even said
    kinds = kind_table(_reported_record())
    assert kinds.title == "by kind of prompt: acceptance and speedup (decoding), 95% intervals over the kind's prompts"
    assert [c.header for c in kinds.columns] == ["kind", "self-draft: acceptance | speedup", "prompt-lookup: acceptance | speedup"]
    assert table_cells(kinds) == [["code", "0.67 (no interval) | 1.60x (no interval)", "0.50 (no interval) | 1.33x (no interval)"],
                             ["math", "0.83 (no interval) | 1.60x (no interval)", "- | 0.94x (no interval)"]]
    differs = "prompt-lookup: greedy output differs from model.generate's on 1 of 3 prompts (prompt 0 at token 2)"
    versus = "prompt-lookup against self-draft: cannot tell (-0.167 (one prompt: no interval) acceptance, paired over 1 prompt, Student's t)"
    tail = ["the loop's own time, outside forward passes: self-draft 10.0%, prompt-lookup 24.3%; decoding alone 25.0%",
            "the draft's extra memory is its KV cache: self-draft 0.00 MiB at most (0.60 of the whole model's)"]
    assert speculate_verdicts(_reported_record()) == [
        differs,
        "the timings cannot be trusted here: the whole model's decoding, timed twice a prompt (this loop and model.generate, the same tokens in turns), "
        "gave 3 pairs give no 95% interval (at least 6 do); no speedup, c or v below is a finding, so the drafts are said by their acceptance alone",
        "self-draft: acceptance 0.75 (-0.31-1.81) over 2 prompts (what pays: not said, the timings are not trusted)",
        "prompt-lookup: acceptance 0.50 (no interval) over 1 prompt (what pays: not said, the timings are not trusted)",
        versus, *tail]
    assert speculate_verdicts(_reported_record("ok")) == [
        differs,
        "self-draft cannot be told from decoding alone (1.60x (no interval) measured): acceptance 0.75, and at c = 0.33, v = 1.08 and 2.0 tokens a round "
        "it pays above 0.50; at this acceptance a draft step must cost at most 0.61 of a decoding step; measured / expected at the measured v: 1.20",
        "prompt-lookup cannot be told from decoding alone (1.10x (no interval) measured): acceptance 0.50, and at c = 0.00, v = 1.04 and 3.0 tokens a "
        "round it pays above 0.04; at this acceptance a draft step must cost at most 0.28 of a decoding step; measured / expected at the measured v: 0.59",
        versus, "the check of a draft's tokens costs 1.04-1.08 decoding steps (v; Leviathan et al. assume 1)", *tail]
    rows = prompt_rows(_reported_record())
    assert [(r["prompt"], r["draft"]) for r in rows] == [(i, d) for i in range(3) for d in ("self-draft", "prompt-lookup")]
    assert rows[0] == {"prompt": 0, "kind": "code", "source": "s", "prompt_tokens": 5, "draft": "self-draft", "generated": 5, "rounds": 2, "drafted": 4,
                       "accepted": 2, "checks": 2, "decode_s": 0.5, "plain_decode_s": 0.8, "draft_s": 0.2, "check_s": 0.25, "plain_step_s": 0.6,
                       "plain_steps": 4, "same_tokens_as_generate": True}
    assert rows[3] == {**rows[3], "rounds": 0, "drafted": 0, "accepted": 0, "checks": 8, "same_tokens_as_generate": True}


@pytest.mark.statistics
def test_the_speedup_figure_draws_each_drafts_measured_expected_and_ceiling_where_they_are(tmp_path):
    """The figure's marks at the summary's values: the measured median with its interval (one prompt's,
    none: a zero-length bar), the expected at v = 1 and at the measured v, the ceiling, the line at 1,
    each draft's name under its marks, and the files written beside the record."""
    from depthcurse.speculate.report import SPECULATE_CSV, SPECULATE_PNG, speedup_figure, write_speculate_files

    record = _reported_record()
    s = record["summary"]["drafts"]
    ax = speedup_figure(record).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    measured = [c for c in ax.containers]
    assert [tuple(np.round(c.lines[0].get_xydata()[0], 6)) for c in measured] == [(-0.15, round(s["self-draft"]["speedup"]["median"], 6)),
                                                                                 (0.85, round(s["prompt-lookup"]["speedup"]["median"], 6))]
    assert measured[0].get_label() == "measured (median, 95%)"
    marks = [(round(float(x), 6), round(float(y), 6), line.get_label()) for line in ax.get_lines() for x, y in line.get_xydata()]
    for x, name in enumerate(s):
        assert (round(x + 0.0, 6), round(s[name]["expected"]["mean"], 6)) in [(m[0], m[1]) for m in marks]
        assert (round(x + 0.15, 6), round(s[name]["expected_v"]["mean"], 6)) in [(m[0], m[1]) for m in marks]
        assert (float(x), round(s[name]["ceiling"], 6)) in [(m[0], m[1]) for m in marks]
    assert {"expected, v = 1", "expected, measured v", "ceiling (every token accepted), v = 1"} <= set(lines)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["expected, v = 1", "expected, measured v", "ceiling (every token accepted), v = 1",
                                                                   "measured (median, 95%)"]  # each once: the first draft's marks name them
    bars = [c.lines[2][0].get_segments()[0] for c in measured]  # one prompt each: no interval, a bar of no length at the median
    assert all(seg[0][1] == seg[1][1] for seg in bars)
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["self-draft", "prompt-lookup"]
    assert ax.get_ylabel() == "speedup of decoding over the whole model alone"
    assert ax.get_title() == "tiny: 3 prompts, draft length at most 2, confidence stop"
    written = write_speculate_files(record, tmp_path)
    assert [p.name for p in written] == [SPECULATE_CSV, SPECULATE_PNG] and all(p.stat().st_size for p in written)
    assert (tmp_path / SPECULATE_CSV).read_text().splitlines()[0].startswith("prompt,kind,source,prompt_tokens,draft,generated,rounds")


@pytest.mark.statistics
def test_the_sampling_rules_edges_and_the_seeded_generator_by_hand():
    """min(1, p/q) at q(x) = 0 is 1 (not a division by zero); the residual of p against itself is p;
    a certain proposal's residual is p without its token; sampling draws from a generator seeded by
    the settings' seed (the same draws whatever torch's global seed), greedy from none; and a rejected
    certain proposal is never replaced by itself."""
    p = torch.tensor([0.5, 0.3, 0.2])
    assert acceptance_probability(p, torch.tensor([0.0, 0.5, 0.5]), 0) == 1.0
    assert acceptance_probability(p, torch.tensor([0.25, 0.5, 0.25]), 1) == pytest.approx(0.6)
    assert torch.equal(residual(p, p.clone(), 1), p)
    assert torch.allclose(residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    assert DecodeSettings(temperature=0.0, seed=3).sampler().generator is None

    def draws(seed, global_seed):
        torch.manual_seed(global_seed)
        sampler = DecodeSettings(temperature=0.5, seed=seed).sampler()
        return [sampler.draw(p) for _ in range(20)] + [accept_sampled(torch.stack([p, p]), None, [0], sampler)[0][0] for _ in range(20)]

    assert draws(3, 0) == draws(3, 1) != draws(4, 0)
    sampler = DecodeSettings(temperature=1.0, seed=0).sampler()
    outcomes = [accept_sampled(torch.stack([p, p]), None, [0], sampler) for _ in range(300)]
    rejected = [kept for kept, n in outcomes if n == 0]
    assert 100 < len(rejected) < 200 and all(len(kept) == 1 and kept[0] != 0 for kept in rejected)
    kept, n = accept_sampled(torch.stack([p, p, p]), torch.stack([p, p]), [2, 1], sampler)  # q = p: every token accepted, then the bonus
    assert n == 2 and kept[:2] == [2, 1] and len(kept) == 3


@pytest.mark.statistics
def test_the_confidence_policy_edges_and_a_bad_length_by_hand():
    """A round that drafted nothing is not heard; one of 1 drafted and 1 accepted is (smoothing 0.5:
    matchness 0.5); matchness exactly at the target counts as reached (the threshold holds at a full
    round, falls by the step otherwise); every check is counted; draft length 1 is allowed, 0 and an
    unknown policy are one line each."""
    policy = Confidence(max_draft=4, threshold=0.8)
    policy.update(0, 0)
    assert (policy.checks, policy.matchness, policy.threshold) == (0, 0.0, 0.8)
    policy.update(1, 1)
    assert policy.checks == 1 and policy.matchness == pytest.approx(0.5) and policy.threshold == pytest.approx(0.9 * 0.8 + 0.1 * 0.81)
    at_target = Confidence(max_draft=4, threshold=0.8, smoothing=0.0, target=0.5)
    at_target.update(1, 2)  # matchness 0.5 = the target, stopped early: the threshold falls
    assert at_target.threshold == pytest.approx(0.9 * 0.8 + 0.1 * 0.79)
    full = Confidence(max_draft=2, threshold=0.8, smoothing=0.0, target=0.5)
    full.update(1, 2)  # at the target after a full round: it holds
    assert full.threshold == pytest.approx(0.8)
    every = Confidence(every=2)
    for _ in range(3):
        every.update(1, 2)
    assert every.checks == 3
    assert build_length("fixed", 1).most() == 1 and build_length("heuristic", 1).most() == 1
    from depthcurse.errors import DepthcurseError

    with pytest.raises(DepthcurseError, match=r"^unknown --draft-length 'medusa': use fixed, confidence, heuristic$"):
        build_length("medusa", 4)
    with pytest.raises(DepthcurseError, match=r"^--draft-tokens must be at least 1, got 0$"):
        build_length("fixed", 0)


@pytest.mark.statistics
def test_a_prompts_figures_where_nothing_was_timed_are_none_and_one_pair_has_no_interval():
    """Guards by hand: no whole-model step timed gives no c and no v; a draft with no check, no v and
    no tokens per check; no decoding time, no overhead and no tokens/s; one value has no interval;
    a comparison of one prompt has none; a record with no generate beside it cannot judge its timings."""
    from depthcurse.speculate.summary import _estimate, _prompt_figures, _versus, timing_check

    plain = {"step_s": 0.0, "steps": 0, "decode_s": 0.5, "prefill_s": 0.1, "generated": 2}
    draft = {"rounds": [[2, 1]], "draft_s": 0.1, "draft_calls": 2, "steps": 0, "step_s": 0.0, "decode_s": 0.0, "prefill_s": 0.1, "draft_prefill_s": 0.0,
             "generated": 3}
    got = _prompt_figures(plain, draft)
    assert got["c"] is None and got["v"] is None and got["tokens_per_check"] is None and got["overhead"] is None and got["tokens_per_s"] is None
    timed = _prompt_figures({**plain, "step_s": 0.4, "steps": 4, "generated": 5}, {**draft, "draft_calls": 0, "steps": 0})
    assert timed["c"] == 0.0 and timed["v"] is None
    assert _estimate([2.0]) == {"mean": 2.0, "interval": None, "n": 1} and _estimate([1.0, 3.0])["interval"] is not None
    one = {"kind": "k", "plain": {"step_s": 0.2, "steps": 2, "decode_s": 0.3, "prefill_s": 0.1, "generated": 2}}
    rounds = {"rounds": [[2, 1]], "draft_s": 0.1, "draft_calls": 2, "steps": 1, "step_s": 0.1, "decode_s": 0.2, "prefill_s": 0.1, "draft_prefill_s": 0.0,
              "generated": 2}
    prompts = [{**one, "a": rounds, "b": {**rounds, "rounds": [[2, 2]]}}, {**one, "a": rounds, "b": {**rounds, "generated": 1}}]
    assert _versus(prompts, "b", "a") == {"against": "a", "difference": pytest.approx(1.0 - 0.5), "interval": None, "prompts": 1, "verdict": "cannot tell"}
    two = prompts[:1] * 2
    assert _versus(two, "b", "a")["interval"] == [pytest.approx(0.5), pytest.approx(0.5)] and _versus(two, "b", "a")["prompts"] == 2
    assert timing_check([one]) == {"status": "unstable", "reason": "no prompt has model.generate's time beside this loop's, nothing to judge "
                                   "the timings by", "prompts": 0}
    got = timing_check([{**one, "generate": {"seconds": s}} for s in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2)] + [{**one, "generate": {"seconds": 0.0}}])
    assert got["prompts"] == 6 and got["status"] == "unstable"
    assert summarise({"prompts": {"0": one}})["drafts"] == {} and summarise({"prompts": {"0": one}})["versus"] == {}


@pytest.mark.statistics
def test_a_drafts_seconds_add_up_over_its_passes_on_a_clock_the_test_holds():
    """The draft's prefill seconds add over prompts and its forward passes' seconds over calls (a watch
    that says 0.25 s each time); prompt lookup: n from the largest down by one, a match whose next
    tokens run to the sequence's end proposes them, one with nothing after it none, and the copy stops
    before an end-of-sequence token."""
    model = tiny_llama(50, layers=4, seed=3)
    draft = LayerSkipDraft(model, (1,), watch=lambda fn: (fn(), 0.25))
    draft.start(PROMPT)
    draft.start(PROMPT)
    assert draft.cost.prefill_seconds == 0.5
    proposal = draft.propose(torch.cat([PROMPT, torch.tensor([[5]])], dim=1), 3, None, DecodeSettings().sampler())
    assert len(proposal.tokens) == 3 and draft.cost.seconds == 0.75 and draft.cost.calls == 3
    greedy = DecodeSettings().sampler()
    look = PromptLookupDraft(max_ngram=3, eos=(9,))
    assert look.propose(torch.tensor([[1, 2, 3, 4, 1, 2, 3]]), 5, None, greedy).tokens == [4, 1, 2, 3]  # the 3-gram's match, up to the end
    assert look.propose(torch.tensor([[5, 1, 2, 7, 1, 2]]), 5, None, greedy).tokens == [7, 1, 2]  # 2-gram: the 3-gram has none
    assert PromptLookupDraft(max_ngram=3).propose(torch.tensor([[2, 8, 1, 2, 7, 1, 2]]), 5, None, greedy).tokens == [7, 1, 2]  # the 2-gram before the 1-gram
    assert look.propose(torch.tensor([[1, 2, 9, 4, 1, 2]]), 5, None, greedy).tokens == []  # the copy stops before the eos
    assert look.propose(torch.tensor([[4, 3, 2, 1]]), 5, None, greedy).tokens == []  # nothing repeats
    assert PromptLookupDraft(max_ngram=5).propose(torch.tensor([[7, 7]]), 5, None, greedy).tokens == [7]  # n-grams no longer than the sequence allows
    with pytest.raises(ValueError, match="^prompt lookup matches n-grams of 1 token or more, got 0$"):
        PromptLookupDraft(max_ngram=0)


def test_a_draft_length_past_what_a_round_can_use_is_capped_and_said_and_another_models_pick_is_refused(run_cli, tiny_model_dir, six_dir,
                                                                                                        prompts_file, tmp_path):
    """--draft-tokens 100000 with 6 new tokens: capped at 5 (the tokens after the whole model's first),
    said in a line, kept in the record and the title; a select run's pick made on another model (whose
    layers exist here too) is one line naming both models, not used (issue 81)."""
    from depthcurse.select.scoring import KEPT

    out = tmp_path / "capped"
    code, stdout, err = run_cli("speculate", tiny_model_dir, "--skip", "1", "--prompts", prompts_file, "--max-new-tokens", "6", "--draft-tokens", "100000",
                                "--baselines", "", "--out", out)
    assert code == 0, err
    assert "--draft-tokens 100000: capped at 5, the most a round can ever use with --max-new-tokens 6 (the first token is the whole model's own)" \
        in " ".join(err.split())
    record = json.loads((out / "speculate.json").read_text())
    assert record["run"]["draft_tokens"] == 5  # the title reads it: "draft length 5"
    assert "note: the prompts (each decoded alone, by generate and by every draft): 4 steps to run, the first took " in " ".join(err.split())
    assert record["forecast"]["steps"] == 4 and record["forecast"]["forecast_seconds"] > 0 and record["forecast"]["seconds"] > 0
    select = tmp_path / "select-of-six"
    select.mkdir()
    scores = [0.5] * (KEPT.index("kl") + 1)
    (select / "select.json").write_text(json.dumps({
        "run": {"model": "six", "source": str(six_dir), "revision": None, "n_layers": 6},
        "cells": {"t/exact/kl": {"objective": "kl", "calibration": "t", "layers": [1]}}, "calibration_scores": {"t": {"1": scores}}}))
    assert_one_line_error(*run_cli("speculate", tiny_model_dir, "--skip-from", select, "--prompts", prompts_file, "--out", tmp_path / "b"),
                          f"--skip-from {select} (t/exact/kl): the select run was made on {six_dir}, not on ")
    assert_one_line_error(*run_cli("speculate", tiny_model_dir, "--skip", "1", "--also-skip-from", select, "--prompts", prompts_file, "--out", tmp_path / "c"),
                          f"--also-skip-from {select} (t/exact/kl): the select run was made on {six_dir}, not on ")
    here = json.loads((select / "select.json").read_text())
    here["run"].update(source=str(tiny_model_dir), revision="another-revision")
    (select / "select.json").write_text(json.dumps(here))
    assert_one_line_error(*run_cli("speculate", tiny_model_dir, "--skip-from", select, "--prompts", prompts_file, "--out", tmp_path / "d"),
                          f"--skip-from {select} (t/exact/kl): the select run was made on {tiny_model_dir} @ another-revision, not on {tiny_model_dir}")


def test_the_draft_length_is_capped_where_it_meets_the_new_tokens_and_said_only_to_who_gave_it(run_cli, tiny_model_dir, prompts_file, tmp_path):
    """--draft-tokens equal to --max-new-tokens is one more than a round can use: capped and said; the
    default 4 under --max-new-tokens 4 is capped without a word about an option the user never gave
    (issue 88); --draft-tokens 3 there is what a round can use: kept, nothing said."""
    from depthcurse.speculate import SpeculateConfig

    assert SpeculateConfig(skip=(1,), draft_tokens=4, max_new_tokens=4).checked().draft_tokens == 3
    assert SpeculateConfig(skip=(1,), draft_tokens=3, max_new_tokens=4).checked().draft_tokens == 3
    base = ["speculate", tiny_model_dir, "--skip", "1", "--prompts", prompts_file, "--per-kind", "1", "--max-new-tokens", "4", "--baselines", ""]
    for given, said in ((["--draft-tokens", "4"], "--draft-tokens 4: capped at 3, the most a round can ever use with --max-new-tokens 4"),
                        ([], None), (["--draft-tokens", "3"], None)):
        out = tmp_path / f"d{len(given)}{given[-1] if given else ''}"
        code, stdout, err = run_cli(*base, *given, "--out", out)
        assert code == 0, err
        assert (said in " ".join(err.split())) if said else "capped" not in err, (given, err)
        assert json.loads((out / "speculate.json").read_text())["run"]["draft_tokens"] == 3


@pytest.mark.statistics
def test_every_verdict_lines_other_branches_word_for_word():
    """A summary made by hand for the branches `_three_prompts` does not reach: sampling, a speedup
    whose interval touches 1 from either side (no verdict either way), one whose draft no acceptance
    pays (and the check alone costs more than a round gives), a comparison with its interval and
    word, five differing prompts (four named), a 3 MiB cache; and the table's other settings: a
    heuristic length, a finished run, a sampling title, a figure that is missing ("-")."""
    from depthcurse.speculate.report import prompt_rows, speculate_table, speculate_verdicts

    est = lambda mean, iv=None: {"mean": mean, "interval": iv, "n": 6}  # noqa: E731
    base = {"lossless": {"equal": 6, "compared": 6, "differ": []}, "alpha": est(0.5), "c": est(0.2), "v": est(1.5), "gamma": est(4.0),
            "overhead": est(0.1), "draft_cache_bytes": 3 * 2**20, "draft_cache_share": 0.25}
    drafts = {"touch-low": {**base, "speedup": {"median": 1.1, "interval": [1.0, 1.2], "pairs": 6}},
              "touch-high": {**base, "speedup": {"median": 0.9, "interval": [0.8, 1.0], "pairs": 6}},
              "hopeless": {**base, "speedup": {"median": 0.5, "interval": [0.4, 0.6], "pairs": 6}, "break_even_v": None, "ceiling_v": 0.93,
                           "largest_c": -0.1}}
    differ = [{"prompt": p, "at": 3} for p in range(5)]
    summary = {"drafts": drafts, "plain": {"overhead": est(0.02)}, "timing": {"status": "ok"},
               "versus": {"hopeless": None,  # decoded on no prompt with the first: no line, and the next still said
                          "touch-high": {"against": "touch-low", "difference": -0.25, "interval": [-0.4, -0.1], "prompts": 6, "verdict": "less"}}}
    lines = speculate_verdicts({"run": {"temperature": 0.7}, "summary": summary})
    assert lines[0] == ("sampling at temperature 0.7: each draft's tokens follow the whole model's distribution by Leviathan et al.'s rule "
                        "(tests/test_speculate.py checks the rule exactly and by a chi-square test); no token-for-token check")
    assert lines[1] == "touch-low cannot be told from decoding alone (1.10x (1.00-1.20) measured)"
    assert lines[2] == "touch-high cannot be told from decoding alone (0.90x (0.80-1.00) measured)"
    assert lines[3] == ("hopeless does not pay (0.50x (0.40-0.60) measured): acceptance 0.50, and at c = 0.20, v = 1.50 and 4.0 tokens a round no "
                        "acceptance pays (even every token accepted gives 0.93x); at this acceptance no draft pays however cheap: the check alone "
                        "costs more than the tokens a round gives")
    assert lines[4] == "touch-high against touch-low: accepted less (-0.250 [-0.400, -0.100] acceptance, paired over 6 prompts, Student's t)"
    assert lines[5] == "the check of a draft's tokens costs 1.50 decoding steps (v; Leviathan et al. assume 1)"
    assert lines[6] == "the loop's own time, outside forward passes: touch-low 10.0%, touch-high 10.0%, hopeless 10.0%; decoding alone 2.0%"
    assert lines[7] == ("the draft's extra memory is its KV cache: touch-low 3.00 MiB at most (0.25 of the whole model's), touch-high 3.00 MiB at "
                        "most (0.25 of the whole model's), hopeless 3.00 MiB at most (0.25 of the whole model's)") and len(lines) == 8
    # a record since issue 89 says what computed the check's matmuls
    said = speculate_verdicts({"run": {"temperature": 0.7}, "summary": summary, "check_linear": "the kernel"})
    assert said[5] == "the check of a draft's tokens costs 1.50 decoding steps (v; Leviathan et al. assume 1); its matmuls: the kernel"
    greedy = speculate_verdicts({"run": {"temperature": 0}, "summary": {**summary, "drafts": {"d": {**base, "speedup": None,
                                                                                             "lossless": {"equal": 1, "compared": 6, "differ": differ}}}}})
    assert greedy[0] == ("d: greedy output differs from model.generate's on 5 of 6 prompts (prompt 0 at token 3, prompt 1 at token 3, prompt 2 at "
                         "token 3, prompt 3 at token 3)")
    record = {"run": {"temperature": 0.7, "model": "m", "max_new_tokens": 9, "draft_length": "heuristic", "draft_tokens": 3}, "prompts": {}, "asked": 0,
              "complete": True, "methods": {"d": {"what": "w"}},
              "summary": {"drafts": {"d": {**base, "speedup": None, "end_to_end": None, "tokens_per_s": None, "tokens_per_check": None,
                                           "expected": None, "expected_v": None, "lossless": {"equal": 0, "compared": 0, "differ": []}}},
                          "plain": {"tokens_per_s": None, "lossless": {"equal": 0, "compared": 0, "differ": []}}, "timing": {"status": "ok"}}}
    table = speculate_table(record)
    assert table.title == ("m: drafts checked by the whole model (sampling at temperature 0.7), 0 of 0 prompts, 9 new tokens at most; draft length "
                           "from 3, heuristic")
    assert table_cells(table)[1] == ["d: w", "-", "-", "-", "0.50 (no interval)", "-", "0.20 (no interval)", "1.50 (no interval)", "- | -", "- | -",
                                "- | -", "sampling: -"]
    assert table_cells(table)[0][-1] == "sampling: -"
    record["prompts"] = {str(i): {"kind": "k", "source": "s", "prompt_tokens": 1, "plain": {"decode_s": 1.0, "step_s": 1.0, "steps": 1},
                                  "d": {"generated": 2, "rounds": [], "steps": 1, "decode_s": 1.0, "draft_s": 0.0, "step_s": 1.0}} for i in (10, 9)}
    assert [r["prompt"] for r in prompt_rows(record)] == [9, 10]  # by number, not as text
