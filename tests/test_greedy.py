"""Attention/MLP granularity and greedy depth curves.

References are independent of the code under test: a branch "removed" must equal the same model
with that branch's output projection zeroed (a weight edit, no hooks), through both engines; each
greedy step must pick the unit whose removal the plain path, evaluating every candidate on its
own, finds cheapest.
"""

import copy
import json

import pytest
import torch

from helpers import CORPUS, assert_one_line_error, tiny_bert, tiny_llama
from depthcurse.errors import DepthcurseError
from depthcurse.loading import LoadedModel
from depthcurse.prune import read_curves, replay_orders, run_greedy, run_sweep
from depthcurse.prune.greedy import CurvePoint, DepthCurves, heuristic_orders
from depthcurse.prune.layout import TokenRequest
from depthcurse.prune.scoring import score_requests
from depthcurse.prune.stepping import Stepper
from depthcurse.surgery import find_blocks, removed_units
from depthcurse.tasks import PerplexityTask

# The last projection of each branch: zeroed, the branch adds nothing to the stream.
OUTPUT_PROJECTIONS = {"attn": ("o_proj",), "mlp": ("down_proj", "w2")}


def _model(kind: str, vocab: int = 300):
    import transformers as tf

    torch.manual_seed(2)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, pad_token_id=2, bos_token_id=None)
    if kind == "llama":
        return tiny_llama(vocab)
    if kind == "qwen2-sliding":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=16, max_window_layers=2)).eval()
    if kind == "gemma2":  # post-branch norms: norm(0) must stay 0
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, sliding_window=16)).eval()
    if kind == "mixtral":  # MoE MLP: router and experts
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)).eval()
    if kind == "gpt_neox":  # parallel residual, x + attn(norm(x)) + mlp(norm(x)); its attention is `attention`
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common, rotary_pct=0.25, use_parallel_residual=True)).eval()
    if kind == "phi":  # one norm shared by the parallel branches
        return tf.PhiForCausalLM(tf.PhiConfig(**common, partial_rotary_factor=0.5)).eval()
    if kind == "falcon":  # parallel branches, one key/value head; its attention is `self_attention`
        return tf.FalconForCausalLM(tf.FalconConfig(**common)).eval()
    raise ValueError(kind)


def _zeroed(model, layers, is_projection) -> torch.nn.Module:
    """A copy of `model` with the parameters `is_projection(name)` picks in the given blocks zeroed."""
    ref = copy.deepcopy(model)
    blocks = find_blocks(ref).layers
    for i in layers:
        for name, param in blocks[i].named_parameters():
            if is_projection(name):
                param.data.zero_()
    return ref


# The branches' last projections where they are not named as Llama's, by parameter-name prefix in the block.
PROJECTIONS = {"gpt_neox": {"attn": "attention.dense.", "mlp": "mlp.dense_4h_to_h."},
               "phi": {"attn": "self_attn.dense.", "mlp": "mlp.fc2."},
               "falcon": {"attn": "self_attention.dense.", "mlp": "mlp.dense_4h_to_h."}}


def _decoder_projection(kind: str, part: str):
    if kind in PROJECTIONS:
        return lambda name: name.startswith(PROJECTIONS[kind][part])
    return lambda name: any(p in name.split(".") for p in OUTPUT_PROJECTIONS[part]) and (".self_attn." in f".{name}") == (part == "attn")


def _log_likelihoods(model, requests):
    out = []
    with torch.no_grad():
        for r in requests:
            logp = model(torch.tensor([r.inputs])).logits[0].float().log_softmax(-1)
            out.append(logp[torch.arange(r.start, r.start + len(r.targets)), torch.tensor(r.targets)].sum().item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["llama", "qwen2-sliding", "gemma2", "mixtral", "gpt_neox", "phi", "falcon"])
@pytest.mark.parametrize("part", ["attn", "mlp"])
def test_a_removed_branch_equals_its_output_zeroed_in_both_engines(kind, part, one_torch_thread):
    model = _model(kind)
    gen = torch.Generator().manual_seed(0)
    requests = [TokenRequest(tuple(torch.randint(0, 300, (n,), generator=gen).tolist()), n - 4, tuple(torch.randint(0, 300, (4,), generator=gen).tolist())) for n in (30, 12, 21)]
    variants = [(), (0,), (2,), (3,), (1, 3)]
    engine, _, _ = score_requests(Stepper(model), requests, variants, max_memory=2**30, granularity=part)
    for vi, removed in enumerate(variants):
        want = _log_likelihoods(_zeroed(model, removed, _decoder_projection(kind, part)), requests)
        with removed_units(model, removed, part):
            plain = _log_likelihoods(model, requests)
        torch.testing.assert_close(plain, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(engine[vi], want, rtol=0, atol=1e-4)
    if variants[1]:  # the zeroing is real: removing a branch changes the scores
        assert not torch.allclose(engine[1], engine[0])
    assert not any(b._forward_hooks for b in model.modules())  # everything put back


# Post-LN encoders, which only the plain path runs (the reuse engine is for decoders): each branch
# ends before the add and norm. Each with the projection that ends each branch, by parameter-name
# prefix inside the block.
PLAIN_ONLY = {
    "bert": {"attn": "attention.output.dense.", "mlp": "output.dense."},
    "deberta_v2": {"attn": "attention.output.dense.", "mlp": "output.dense."},
    "distilbert": {"attn": "attention.out_lin.", "mlp": "ffn.lin2."},
    "mpnet": {"attn": "attention.attn.o.", "mlp": "output.dense."},
}


def _plain_only_model(kind: str):
    import transformers as tf

    torch.manual_seed(3)
    enc = dict(vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, max_position_embeddings=128)
    if kind == "bert":
        model = tiny_bert(300)
    elif kind == "deberta_v2":  # relative attention, its own layer classes
        model = tf.DebertaV2ForQuestionAnswering(tf.DebertaV2Config(**enc, relative_attention=True, pos_att_type=["c2p", "p2c"])).eval()
    elif kind == "distilbert":
        model = tf.DistilBertForQuestionAnswering(tf.DistilBertConfig(vocab_size=300, dim=32, n_layers=4, n_heads=4, hidden_dim=64, max_position_embeddings=128)).eval()
    elif kind == "mpnet":
        model = tf.MPNetForQuestionAnswering(tf.MPNetConfig(**enc)).eval()
    else:
        raise ValueError(kind)
    # Trained norms, not the init's weight 1 and bias 0: a block's input is already the output of
    # such a norm, which then leaves it as it is, and a removed branch that left h instead of
    # norm(h) would pass unnoticed.
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.weight.data = torch.rand(module.weight.shape) + 0.5
            module.bias.data = 0.3 * torch.randn(module.bias.shape)
    return model


@pytest.mark.parametrize("kind", list(PLAIN_ONLY))
@pytest.mark.parametrize("part", ["attn", "mlp"])
def test_a_removed_branch_equals_its_output_zeroed_in_post_ln_blocks(kind, part, one_torch_thread):
    model = _plain_only_model(kind)
    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(0))

    def outputs(m):
        with torch.no_grad():
            out = m(input_ids=ids)
        return torch.cat([out.start_logits, out.end_logits], -1) if hasattr(out, "start_logits") else out.logits

    for removed in [(0,), (2,), (1, 3)]:
        ref = _zeroed(model, removed, lambda name: name.startswith(PLAIN_ONLY[kind][part]))
        with removed_units(model, removed, part):
            got = outputs(model)
        torch.testing.assert_close(got, outputs(ref), rtol=0, atol=1e-5)
        assert not torch.allclose(got, outputs(model), atol=1e-4)  # the branch did something
    assert not any(b._forward_hooks for b in model.modules())


def test_granularity_errors_are_one_clear_line():
    import transformers as tf

    opt = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32)).eval()
    with pytest.raises(DepthcurseError, match="--granularity mlp is not defined for OPTDecoderLayer: it has no MLP module"):
        with removed_units(opt, [0], "mlp"):  # its MLP is two bare linears in the block
            pass
    with pytest.raises(DepthcurseError, match="unknown --granularity 'heads'"):
        with removed_units(tiny_llama(300), [0], "heads"):
            pass


def _loaded(model, tokenizer):
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny", source="tiny", dtype=torch.float32, device=torch.device("cpu"))


def _ppl_task(tokenizer):
    return PerplexityTask(tokenizer, CORPUS * 8, source="corpus", seq_len=32, limit=4, batch_size=4)


@pytest.mark.parametrize("granularity", ["layer", "mlp"])
def test_each_greedy_step_removes_the_cheapest_unit(granularity, tiny_tokenizer, tmp_path, one_torch_thread):
    model = tiny_llama(len(tiny_tokenizer), layers=5, seed=3)
    task = _ppl_task(tiny_tokenizer)
    result = run_greedy(_loaded(model, tiny_tokenizer), task, tmp_path, steps=3, granularity=granularity)
    greedy = result.curves["greedy"]
    assert [p.k for p in greedy] == [0, 1, 2, 3]
    removed = []
    for point in greedy[1:]:
        losses = {}
        for u in range(5):  # every remaining candidate, evaluated on its own by the plain path
            if u not in removed:
                with removed_units(model, removed + [u], granularity):
                    losses[u] = task.evaluate(model).metrics["loss"]
        cheapest = min(losses, key=lambda u: (losses[u], u))
        removed.append(cheapest)
        assert point.removed == sorted(removed)
        assert point.metric == pytest.approx(losses[cheapest], abs=1e-5)
    on_disk = json.loads((tmp_path / "greedy.json").read_text())
    assert on_disk["granularity"] == granularity and read_curves(tmp_path).curves["greedy"][-1].removed == sorted(removed)
    steps_wall = sum(json.loads(p.read_text())["wall_time_s"] for p in sorted((tmp_path / "steps").glob("*/prune.json")))
    orders_wall = json.loads((tmp_path / "orders" / "prune.json").read_text())["wall_time_s"] if (tmp_path / "orders").is_dir() else 0.0
    assert on_disk["wall_time_s"] == round(steps_wall + orders_wall, 3) > 0 and {"command", "commit", "packages"} <= set(on_disk["environment"])
    assert read_curves(tmp_path).made == {"wall_time_s": on_disk["wall_time_s"], "environment": on_disk["environment"]}  # how it was made, read back
    # the one-shot order is step 1's ranking; "last" is the deepest units before the final one
    assert result.curves["last"][2].removed == [2, 3]
    assert result.curves["one-shot"][1].removed == greedy[1].removed
    # every strategy's point is its set's score, though sets a step measured are not measured again
    for name, points in result.curves.items():
        for point in points[1:]:
            with removed_units(model, point.removed, granularity):
                assert point.metric == pytest.approx(task.evaluate(model).metrics["loss"], abs=1e-5), (name, point.removed)
    orders = tmp_path / "orders" / "prune.json"  # absent when the steps measured every set
    again = [v["removed"] for v in json.loads(orders.read_text())["variants"]] if orders.exists() else []
    assert not any(len(r) == 1 for r in again)  # the singles come from step 1
    if granularity == "mlp":
        assert "not defined for --granularity mlp" in result.notes["angular"]


def test_an_interrupted_greedy_search_ends_where_an_uninterrupted_one_does(tiny_tokenizer, tmp_path, one_torch_thread):
    model = tiny_llama(len(tiny_tokenizer), layers=5, seed=4)
    task = _ppl_task(tiny_tokenizer)
    loaded = _loaded(model, tiny_tokenizer)
    whole = run_greedy(loaded, task, tmp_path / "whole", steps=3, compare=False)

    def stop_in_step_two(label, done, total):
        if label.startswith("step 2"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_greedy(loaded, task, tmp_path / "cut", steps=3, compare=False, on_step=stop_in_step_two)
    assert (tmp_path / "cut" / "steps" / "001" / "prune.json").exists()
    seen = []
    resumed = run_greedy(loaded, task, tmp_path / "cut", steps=3, compare=False, on_variant=lambda label, done, total: seen.append(label))
    assert [p.removed for p in resumed.curves["greedy"]] == [p.removed for p in whole.curves["greedy"]]
    assert [p.metric for p in resumed.curves["greedy"]] == [p.metric for p in whole.curves["greedy"]]
    # step 1 was not recomputed: its sweep was complete on disk
    step1 = json.loads((tmp_path / "cut" / "steps" / "001" / "prune.json").read_text())
    assert len(step1["variants"]) == 6


def test_orders_replayed_on_held_out_text_are_those_sets_measured_there(tiny_tokenizer, tmp_path, one_torch_thread):
    """--orders: every strategy's sets, chosen on one text, measured on another; each point equals
    the plain path evaluating that set on its own there, and on the text they were chosen on the
    replay gives back the chosen numbers."""
    model = tiny_llama(len(tiny_tokenizer), layers=5, seed=3)
    loaded = _loaded(model, tiny_tokenizer)
    chosen_on = _ppl_task(tiny_tokenizer)
    held_out = PerplexityTask(tiny_tokenizer, list(reversed(CORPUS)) * 8, source="held-out", seq_len=24, limit=3, batch_size=4)
    chosen = run_greedy(loaded, chosen_on, tmp_path / "chosen", steps=2)
    same = replay_orders(loaded, chosen_on, read_curves(tmp_path / "chosen"), tmp_path / "same", source="chosen")
    other = replay_orders(loaded, held_out, read_curves(tmp_path / "chosen"), tmp_path / "other", source="chosen")
    assert set(other.curves) == set(chosen.curves) == {"greedy", "one-shot", "last"}
    for name, points in chosen.curves.items():
        assert [p.removed for p in other.curves[name]] == [p.removed for p in same.curves[name]] == [p.removed for p in points]
        assert [p.metric for p in same.curves[name]] == pytest.approx([p.metric for p in points], abs=1e-6)
        for p in other.curves[name]:
            with removed_units(model, p.removed, "layer"):
                assert p.metric == pytest.approx(held_out.evaluate(model).metrics["loss"], abs=1e-5)
    assert other.curves["greedy"][2].metric != pytest.approx(chosen.curves["greedy"][2].metric, abs=1e-3)  # other text, other losses
    assert read_curves(tmp_path / "other").run["orders_from"] == "chosen (ppl on corpus)" and other.run["data"] == "held-out"
    with pytest.raises(DepthcurseError, match="chosen on a model with 5 layers; LlamaForCausalLM has 4"):
        replay_orders(_loaded(tiny_llama(len(tiny_tokenizer)), tiny_tokenizer), held_out, chosen, tmp_path / "bad")


def test_greedy_refuses_bad_input(tiny_tokenizer, tmp_path):
    loaded = _loaded(tiny_llama(len(tiny_tokenizer)), tiny_tokenizer)
    task = _ppl_task(tiny_tokenizer)
    with pytest.raises(DepthcurseError, match="--greedy 4 is out of range: LlamaForCausalLM has 4 layers, so 1-3 layer units"):
        run_greedy(loaded, task, tmp_path, steps=4)
    with pytest.raises(DepthcurseError, match="--max-drop must be positive"):
        run_greedy(loaded, task, tmp_path, steps=2, max_drop=0)


def test_the_last_n_order_stays_in_range_when_every_branch_goes(tiny_tokenizer, tmp_path, one_torch_thread):
    sweep = run_sweep(_loaded(tiny_llama(len(tiny_tokenizer), layers=3), tiny_tokenizer), _ppl_task(tiny_tokenizer), [0, 1, 2], tmp_path, granularity="attn")
    orders, _ = heuristic_orders(3, "attn", 3, sweep)
    assert orders["last"] == [(1,), (0, 1), (0, 1, 2)]  # before the final one, then all three
    assert sorted(orders["one-shot"][-1]) == [0, 1, 2]


def test_the_heuristic_orders_take_the_lowest_block_influence_and_the_argmin_angular_block_first(tiny_tokenizer, tmp_path, one_torch_thread):
    """ShortGPT removes the layers whose Block Influence, 1 - cos(x_l, x_l+1), is lowest first;
    Gromov et al. the block l*..l*+n-1 with the smallest d(x_l, x_l+n). Both from an angular
    pass whose numbers are chosen here, so that the right order and its reverse differ."""
    from depthcurse.angular import AngularResult

    L = 5
    pairwise = [[abs(j - i) * 0.1 for j in range(L + 1)] for i in range(L + 1)]
    pairwise[2][4] = pairwise[4][2] = 0.01  # layers 2-3 barely change the stream
    angular = AngularResult(num_layers=L, max_n=L, position="last", pairwise=pairwise, samples=1, stat_tokens=1,
                            block_influence=[0.9, 0.2, 0.05, 0.4, 0.7], relative_update=[0.0] * L, norm=[1.0] * (L + 1), variance=[1.0] * (L + 1))
    sweep = run_sweep(_loaded(tiny_llama(len(tiny_tokenizer), layers=L), tiny_tokenizer), _ppl_task(tiny_tokenizer), range(L), tmp_path)
    orders, notes = heuristic_orders(L, "layer", 3, sweep, angular)
    assert orders["block-influence"] == [(2,), (1, 2), (1, 2, 3)]
    assert orders["angular"][1] == (2, 3) and not notes


def test_a_curve_point_that_is_not_a_number_ends_what_counts_as_within_the_drop():
    """A variant whose score came out NaN (a loss that overflowed) is not a cheap removal."""
    nan = float("nan")
    points = [CurvePoint(k, list(range(k)), 1 + r, r, r) for k, r in enumerate((0.0, 0.001, nan, 0.002))]
    result = DepthCurves({}, "layer", 5, "loss", False, {"greedy": points})
    assert [result.units_within("greedy", t) for t in (0.01, 0.05, 0.10)] == [1, 1, 1]
    assert result.to_json()["units_within"]["greedy"] == {"1%": 1, "5%": 1, "10%": 1}


def test_units_within_a_drop_count_until_the_curve_passes_it_and_say_when_it_stopped_first():
    def curve(*rel):
        return [CurvePoint(k, list(range(k)), 1 + r, r, r) for k, r in enumerate((0.0, *rel))]

    result = DepthCurves({}, "layer", 4, "loss", False, {"greedy": curve(0.005, 0.03, 0.2), "last": curve(0.02), "one-shot": curve(0.001, 0.002, 0.004)})
    assert [result.units_within("greedy", t) for t in (0.01, 0.05, 0.10)] == [1, 2, 2]
    assert [result.within_text("greedy", t) for t in (0.01, 0.05, 0.10)] == ["1", "2", "2"]  # passed each
    assert [result.within_text("last", t) for t in (0.01, 0.05)] == ["0", "≥1"]  # one step only: more might go
    assert result.within_text("one-shot", 0.01) == "3"  # all 3 layers that can go (4 - 1) are gone


def test_cli_greedy_and_granularity(run_cli, tiny_model_dir, text_file, tmp_path):
    base = ["prune", str(tiny_model_dir), "--data", str(text_file), "--seq-len", "32", "--limit", "3"]
    assert_one_line_error(*run_cli(*base, "--granularity", "heads"), "unknown --granularity 'heads'")
    assert_one_line_error(*run_cli(*base, "--greedy", "9"), "--greedy 9 is out of range")
    assert_one_line_error(*run_cli(*base, "--max-drop", "0.1"), "--max-drop only applies with --greedy")
    out = tmp_path / "greedy"
    code, stdout, err = run_cli(*base, "--greedy", "2", "--granularity", "attn", "--out", str(out))
    assert code == 0, err
    assert "attention branches removable" in stdout and (out / "greedy.png").exists() and (out / "greedy.csv").exists()
    data = json.loads((out / "greedy.json").read_text())
    assert data["granularity"] == "attn" and [len(p["removed"]) for p in data["curves"]["greedy"]] == [0, 1, 2]
    # --max-drop in heal's form too (issue 90): 5% and 0.05 reach the greedy loop as the same share
    from depthcurse.cli import prune as prune_cli

    seen = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prune_cli, "_prune_greedy", lambda *args, **kw: seen.append(args[5]))
        for share in ("5%", "0.05"):
            assert run_cli(*base, "--greedy", "2", "--max-drop", share, "--out", str(tmp_path / "s"))[0] == 0
    assert seen == [0.05, 0.05]
    assert_one_line_error(*run_cli(*base, "--greedy", "2", "--max-drop", "150%"), "--max-drop 150%: a share is more than 0% and at most 100%")
    sweep = tmp_path / "mlp"
    code, _, err = run_cli(*base, "--granularity", "mlp", "--layers", "1", "--out", str(sweep))
    assert code == 0, err
    assert json.loads((sweep / "prune.json").read_text())["run"]["granularity"] == "mlp"
    # the greedy result's orders on other windows of the text: held out
    other = ["prune", str(tiny_model_dir), "--data", str(text_file), "--seq-len", "24", "--limit", "3"]
    assert_one_line_error(*run_cli(*other, "--orders", str(sweep)), "holds no greedy result")
    assert_one_line_error(*run_cli(*other, "--orders", str(out), "--granularity", "mlp"), "remove attn units, not mlp")
    assert_one_line_error(*run_cli(*other, "--orders", str(out), "--greedy", "2"), "--orders measures the sets of an earlier --greedy result")
    code, stdout, err = run_cli(*other, "--orders", str(out), "--out", str(tmp_path / "held-out"))
    assert code == 0, err
    replayed = json.loads((tmp_path / "held-out" / "greedy.json").read_text())
    assert replayed["granularity"] == "attn" and [p["removed"] for p in replayed["curves"]["greedy"]] == [p["removed"] for p in data["curves"]["greedy"]]
    assert replayed["run"]["seq_len"] == 24 and "attention branches removable" in stdout and "orders chosen on" in " ".join(stdout.split())


def test_report_renders_one_page_from_folders_of_three_kinds(run_cli, tiny_model_dir, text_file, tmp_path):
    base = ["prune", str(tiny_model_dir), "--data", str(text_file), "--seq-len", "32", "--limit", "3"]
    # --greedy also measures the angular pass its block-influence and angular orders need, on --angular-data
    assert run_cli(*base, "--greedy", "2", "--angular-data", str(text_file), "--angular-tokens", "300", "--out", str(tmp_path / "greedy"))[0] == 0
    assert run_cli(*base, "--out", str(tmp_path / "sweep"))[0] == 0
    assert run_cli("angular-distance", tiny_model_dir, "--data", text_file, "--tokens", "300", "--seq-len", "16", "--out", tmp_path / "ang")[0] == 0
    curves = read_curves(tmp_path / "greedy")
    assert set(curves.curves) == {"greedy", "one-shot", "block-influence", "angular", "last"} and not curves.notes
    page = tmp_path / "site" / "page.md"
    code, stdout, err = run_cli("report", tmp_path / "sweep", tmp_path / "greedy", tmp_path / "ang", "--out", page)
    assert code == 0, err
    text = page.read_text()
    for heading in ("## Prune sweeps", "## Greedy depth curves", "## Angular distance"):
        assert heading in text
    linked = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(linked) == 4 and all((page.parent / link).is_file() for link in linked)
    assert "| block-influence |" in text
    assert_one_line_error(*run_cli("report", tmp_path / "sweep" / "prune.png"), "is not a folder")
    assert_one_line_error(*run_cli("report", tmp_path / "greedy" / "steps"), "holds no depthcurse result")
    assert_one_line_error(*run_cli("report", tmp_path / "sweep", "--out", tmp_path / "page.html"), "give a .md path")


def test_report_and_plot_say_what_each_folder_measured(run_cli, tiny_model_dir, text_file, tmp_path, monkeypatch):
    """A layer sweep and an attention sweep of one model, a --block result, a greedy curve and its
    orders replayed on other windows, a sweep of a few layers and an interrupted one: each is told
    apart on the page, with its data, and counts only what it measured."""
    import matplotlib

    from depthcurse.prune import report as prune_report
    from depthcurse.prune.results import read_sweep

    base = ["prune", str(tiny_model_dir), "--data", str(text_file), "--seq-len", "32", "--limit", "3"]
    for name, extra in (("layers", []), ("attn", ["--granularity", "attn"]), ("few", ["--layers", "1-2"]), ("cut", []),
                        ("block", ["--block", "2", "--angular-data", str(text_file), "--angular-tokens", "300"]), ("greedy", ["--greedy", "1"])):
        assert run_cli(*base, *extra, "--out", str(tmp_path / name))[0] == 0, name
    assert run_cli("prune", tiny_model_dir, "--data", text_file, "--seq-len", "24", "--limit", "3", "--orders", tmp_path / "greedy", "--out", tmp_path / "orders")[0] == 0
    cut = json.loads((tmp_path / "cut" / "prune.json").read_text())  # as a sweep interrupted after two variants leaves it
    cut["variants"] = cut["variants"][:3]
    (tmp_path / "cut" / "prune.json").write_text(json.dumps(cut))
    assert read_sweep(tmp_path / "cut").status_text().startswith("partial: 3 of 5 variants measured")

    labels = [prune_report.sweep_label(read_sweep(tmp_path / n)) for n in ("layers", "attn")]
    assert "one layer removed" in labels[0] and "one attention branch removed" in labels[1]
    figures = []
    monkeypatch.setattr(prune_report, "save_figure", lambda fig, path: figures.append(fig) or path)
    page = tmp_path / "page.md"
    code, _, err = run_cli("report", *(tmp_path / n for n in ("layers", "attn", "few", "cut", "block", "greedy", "orders")), "--out", page)
    assert code == 0, err  # a --block folder no longer refuses the page
    text = page.read_text()
    assert "## Blocks of contiguous layers removed" in text and "| angular |" in text and "| deepest |" in text
    rows = {line.split(" | ")[-1].strip(" |"): line for line in text.splitlines() if line.startswith(f"| {tiny_model_dir} |")}
    assert "| attention branch |" in rows[str(tmp_path / "attn")] and "| layer |" in rows[str(tmp_path / "layers")]
    assert "3 windows x 32 tokens of" in rows[str(tmp_path / "layers")]
    assert " of 2 measured |" in rows[str(tmp_path / "few")] and "| complete |" in rows[str(tmp_path / "few")]
    assert " of 2 measured |" in rows[str(tmp_path / "cut")] and "| partial: 3 of 5 variants measured" in rows[str(tmp_path / "cut")]
    headings = [line for line in text.splitlines() if line.startswith(f"### {tiny_model_dir}")]
    assert len(headings) == 2 and headings[0] != headings[1] and "orders chosen on" in headings[1]  # greedy and its replay told apart
    # every legend sits below its axes, where it hides no curve
    for fig in figures:
        fig.canvas.draw()
        (ax,) = fig.axes
        assert ax.get_legend() is None and fig.legends
        assert fig.legends[0].get_window_extent().y1 <= ax.get_window_extent().y0 + 1
        matplotlib.pyplot.close(fig)
