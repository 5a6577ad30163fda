"""The recovery-method contract checked where it is used, and the pieces around it that a plugin's
or our own slip would turn into a wrong result: names both ways in `--method-args`, a setting's
type, every method's defaults pinned to its paper, what a checkpoint holds against what was
measured, the card's model-index, retained and its noise, `speed`'s verdicts and stopping rule.

The references are independent of the code under test: classes written here that break one rule
each, numbers written out by hand, checkpoints loaded back by plain transformers, a clock that
counts blocks (no timing in a test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re

import pytest
import torch

from helpers import heal_config, tiny_llama

from depthcurse.errors import DepthcurseError
from depthcurse.heal import HealContext, build_method, heal, heal_table
from depthcurse.heal.healed import Healed
from depthcurse.heal.method import builtin_methods, find_method
from depthcurse.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(docs_file, **kw):
    options = dict(layers=(2, 3), data=str(docs_file), steps=2, batch_size=4, seq_len=24, lr=5e-3, eval_windows=4, save_every=2, calib_tokens=240)
    return heal_config(**{**options, **kw})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


BROKEN = '''
import contextlib
import torch
from depthcurse.heal.method import Method

class YieldsNothing(Method):
    name = "yields-nothing"
    @contextlib.contextmanager
    def applied(self, model):
        yield

class NoContext(Method):
    name = "no-context"
    def applied(self, model):
        return None

class RaisesEntering(Method):
    name = "raises-entering"
    @contextlib.contextmanager
    def applied(self, model):
        raise KeyError("no such block")
        yield model

class RaisesInFinalize(Method):
    name = "raises-in-finalize"
    def finalize(self, model):
        raise RuntimeError("shapes differ")

class FinalizeGivesNothing(Method):
    name = "finalize-gives-nothing"
    def finalize(self, model):
        model.lm_head.weight.data.mul_(1.0)

class RaisesInCost(Method):
    name = "raises-in-cost"
    def cost(self, model, layers):
        return {}["trained_params"]

class YieldsCopy(Method):
    name = "yields-copy"
    @contextlib.contextmanager
    def applied(self, model):
        import copy
        yield copy.deepcopy(model)  # the heal would measure a model it does not go on to save

class ObjectiveNotModule(Method):
    name = "objective-not-module"
    trains = True
    def objective(self, ctx):
        return lambda ids, targets: ids.float().sum()
'''


@pytest.mark.parametrize("attr, said", [
    ("YieldsNothing", "--method yields-nothing: applied() must give the model it was given to the `with` (`yield model`), it gave NoneType"),
    ("YieldsCopy", "--method yields-copy: applied() must give the model it was given to the `with` (`yield model`), it gave another LlamaForCausalLM"),
    ("NoContext", "--method no-context: applied() must return a context manager"),
    ("RaisesEntering", "--method raises-entering: its applied() raised KeyError: 'no such block'"),
    ("RaisesInFinalize", "--method raises-in-finalize: its finalize() raised RuntimeError: shapes differ"),
    ("FinalizeGivesNothing", "--method finalize-gives-nothing: finalize() must return the model it changed, got NoneType"),
    ("RaisesInCost", "--method raises-in-cost: its cost() raised KeyError: 'trained_params'"),
    ("ObjectiveNotModule", "--method objective-not-module: objective() must return an nn.Module ((ids, targets) -> summed loss) or None, got function"),
])
def test_a_method_that_breaks_a_hooks_rule_is_one_line_naming_it_before_its_healed_result(attr, said, bos_model_dir, docs_file, tmp_path):
    """`applied()` that gives no model (the 'healed' model was the plain removal, called healed), no
    context manager, or raises; `finalize()` that raises or gives nothing; any other hook that
    raises: one line naming the method and the hook, and no healed result written."""
    plugin = tmp_path / "broken_hooks.py"
    plugin.write_text(BROKEN)
    with pytest.raises(DepthcurseError) as err:
        heal(load_model(str(bos_model_dir)), _cfg(docs_file, method=f"{plugin}:{attr}"), tmp_path / attr)
    assert said in str(err.value) and "\n" not in str(err.value)
    written = tmp_path / attr / "heal.json"
    assert not written.exists() or "healed" not in json.loads(written.read_text())["results"]


def test_an_error_inside_the_with_is_not_the_methods_and_the_model_is_left_as_it_was():
    """Only entering and leaving a method's context is its own: an error of the code measuring the
    model passes through as it is; a context that gave no model is left again (its changes off)."""
    from depthcurse.heal.method import Method

    class Scales(Method):
        name = "scales-test"

        @contextlib.contextmanager
        def applied(self, model):
            model.lm_head.weight.data.mul_(2.0)
            try:
                yield model
            finally:
                model.lm_head.weight.data.div_(2.0)

    class ScalesNoModel(Scales):
        name = "scales-no-model"

        @contextlib.contextmanager
        def applied(self, model):
            with Scales.applied(self, model):
                yield None

    model = tiny_llama(300, layers=3)
    before = model.lm_head.weight.detach().clone()
    with pytest.raises(ZeroDivisionError):
        with Scales().applied(model):
            1 / 0
    assert torch.equal(model.lm_head.weight, before)
    with pytest.raises(DepthcurseError, match="scales-no-model: applied"):
        with ScalesNoModel().applied(model):
            pass
    assert torch.equal(model.lm_head.weight, before)
    for name, cls in builtin_methods().items():  # ours keep the rule too
        method = cls()
        for hook in ("applied", "bypassed", "placed"):
            with getattr(method, hook)(model) as got:
                assert got is model, (name, hook)


def test_a_method_that_changes_nothing_is_flagged_unchanged_in_the_table_and_card_not_called_healed(bos_model_dir, docs_file, tmp_path):
    """A method that keeps every rule and changes nothing: its healed model measures as the plain
    removal on every window; heal.json, the table and the card say so. A method that changes the
    model is not flagged."""
    from rich.console import Console

    plugin = tmp_path / "idle_method.py"
    plugin.write_text("from depthcurse.heal.method import Method\nclass Idle(Method):\n    name = 'idle'\n")
    record = heal(load_model(str(bos_model_dir)), _cfg(docs_file, method=f"{plugin}:Idle"), tmp_path / "idle")
    assert record["unchanged"] and "changed nothing" in record["unchanged"]
    console = Console(record=True, width=400)
    console.print(heal_table(record))
    from depthcurse.heal import heal_verdicts

    text = " ".join(console.export_text().split())
    assert "healed (unchanged: as pruned)" in text and heal_verdicts(record)[0].startswith("NOT HEALED: ") and "changed nothing" in heal_verdicts(record)[0]
    card = (tmp_path / "idle" / "hf" / "README.md").read_text()
    assert "**Not healed:**" in card
    linear = heal(load_model(str(bos_model_dir)), _cfg(docs_file, method="linear"), tmp_path / "linear")
    assert linear["unchanged"] is None and "Not healed" not in (tmp_path / "linear" / "hf" / "README.md").read_text()


def test_two_methods_of_one_run_with_one_name_are_refused(tmp_path):
    from depthcurse.heal.compare import parse_methods

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "twin.py").write_text("from depthcurse.heal.method import Method\nclass Twin(Method):\n    name = 'twin'\n")
    with pytest.raises(DepthcurseError, match=r"are both named 'twin'"):
        parse_methods(f"{tmp_path / 'a' / 'twin.py'}:Twin,{tmp_path / 'b' / 'twin.py'}:Twin")


def test_an_outside_file_of_the_same_name_in_another_folder_is_its_own_class(tmp_path):
    """Two folders each with `method.py`: each spec gives its own file's class, in either order
    and again (not the first one loaded under the shared module name)."""
    specs = {}
    for folder in ("first", "second"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "method.py").write_text(f"from depthcurse.heal.method import Method\nclass M(Method):\n    name = '{folder}-m'\n")
        specs[folder] = f"{tmp_path / folder / 'method.py'}:M"
    for folder in ("first", "second", "first", "second"):
        assert find_method(specs[folder]).name == f"{folder}-m"


DIAG = '''
from dataclasses import dataclass
from depthcurse.heal.method import Method

@dataclass
class Settings:
    toward_one: float = 1.0
    sharp: bool = False

class DiagScale(Method):
    name = "diag-scale"
    Settings = Settings
'''


def test_a_setting_addresses_a_method_by_its_printed_name_or_its_spec_and_one_no_method_has_is_refused(tmp_path):
    from depthcurse.heal.compare import check_settings
    from depthcurse.heal.config import HealConfig

    plugin = tmp_path / "diag_scale.py"
    plugin.write_text(DIAG)
    spec = f"{plugin}:DiagScale"
    for key in ("diag-scale.toward_one", f"{spec}.toward_one", "toward_one"):
        assert build_method(spec, {key: "0.5"}).settings.toward_one == 0.5
        cfg = HealConfig(layers=(1,), method_args={key: "0.5", "ridge": "0.1"})
        assert cfg.for_method(spec).build().settings.toward_one == 0.5
        assert cfg.for_method("linear").build().settings.ridge == 0.1
        check_settings(cfg, (spec, "linear"))
    with pytest.raises(DepthcurseError, match=r"--method-args lora.lora_rank: no method of --method linear is 'lora'"):
        build_method("linear", {"lora.lora_rank": "4"})  # was dropped without a word
    with pytest.raises(DepthcurseError, match="does not apply to any of --methods"):
        check_settings(HealConfig(layers=(1,), method_args={"other-method.toward_one": "0.5"}), (spec, "linear"))


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("yes", True), ("0", False), ("false", False), ("no", False)])
def test_a_boolean_setting_reads_1_and_0(text, value, tmp_path):
    plugin = tmp_path / "diag_scale.py"
    plugin.write_text(DIAG)
    assert build_method(f"{plugin}:DiagScale", {"sharp": text}).settings.sharp is value
    assert build_method("linearpatch", {"rotate": text}).settings.rotate is value
    with pytest.raises(DepthcurseError, match="takes bool"):
        build_method("linearpatch", {"rotate": "2"})
    with pytest.raises(DepthcurseError, match=r"^--method-args calib_tokens=abc: linear's calib_tokens takes int$"):
        build_method("linear", {"calib_tokens": "abc"})  # was reported as --calib-tokens abc


# Each built-in method's defaults, as its paper and code set them (the module's `source` names both).
PAPER_DEFAULTS = {
    # ReplaceMe (mts-ai/ReplaceMe): least squares on the calibration activations, no regulariser
    "linear": {"calib_tokens": 16384, "ridge": 0.0, "min_fit_ratio": 1.0},  # the last ours: no under-determined map unless asked (fitting.py)
    # ReplaceMe's cosine variant: Adam at 1e-4 from the identity, 10 epochs of 1,024-token batches
    "linear-cosine": {"calib_tokens": 16384, "epochs": 10, "lr": 1e-4, "batch_tokens": 1024, "accurate": False},
    # Gromov et al.: QLoRA on the MLPs, rank 8, alpha 16, dropout 0.05, next-token loss
    "lora": {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.05, "targets": "mlp", "adapt": "all", "loss": "lm"},
    # LinearPatch: P = H D H^T from calibration, not trained unless asked
    "linearpatch": {"calib_tokens": 16384, "rotate": True, "distill": False},
    # Prune&Comp (magcomp.py): a scale per removed layer, round by round
    "prune-comp": {"calib_tokens": 16384, "per": "layer"},
    # Lu et al. (partial-layer fine-tuning): the head and the last three layers
    "tune-last": {"layers": 3, "head": True, "loss": "lm"},
    # LaCo: RDSC as the paper writes it (the notebook's in-place loop one setting away); the notebook's
    # seven projection weights, biases left the base layer's
    "laco": {"as_": "paper", "biases": False},
    # Sliding-Window Merging (SLM.py): merge_layers_return_model(..., weight_factor=1), the seven weights
    "swm": {"weight_factor": 1.0, "biases": False},
}


def test_every_methods_defaults_are_its_papers():
    """A default changed by accident (the cosine map's lr) changes every result that method gives:
    each built-in's settings are pinned here, and a new method must add its own."""
    for name, cls in builtin_methods().items():
        settings = dataclasses.asdict(cls.Settings())
        if not settings:
            continue  # nothing to set: layer, ffn
        assert name in PAPER_DEFAULTS, f"pin {name}'s paper defaults in PAPER_DEFAULTS"
        assert settings == PAPER_DEFAULTS[name], name


def test_a_linear_patch_that_is_not_symmetric_is_saved_as_it_is_applied(tmp_path):
    """LinearPatch's own P = H D H^T is symmetric, so a transposed save passed; a trained patch is
    not: saved with a random one, the checkpoint loaded back gives the healed model's logits."""
    from depthcurse.patches import load_patches

    model = tiny_llama(300, layers=6, seed=3)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    method = build_method("linearpatch", {"distill": "true"})
    method.prepare(HealContext(model=model, layers=(2, 3), calibration=lambda tokens: [ids]))
    with torch.no_grad():
        method.weights["2"].copy_(torch.eye(32) + 0.3 * torch.randn(32, 32, generator=torch.Generator().manual_seed(2)))
    patch = method.weights["2"].detach().clone()
    assert not torch.allclose(patch, patch.T)
    healed = Healed(model, (2, 3), method)
    with healed.as_model("healed") as m:
        measured = _logits(m, ids)
    healed.save(None, tmp_path / "hf")
    torch.testing.assert_close(load_patches(tmp_path / "hf")[2], patch, rtol=0, atol=0)
    saved = load_model(str(tmp_path / "hf"), tokenizer=False).model
    torch.testing.assert_close(_logits(saved, ids), measured, rtol=1e-5, atol=1e-5)


def test_tune_last_on_a_tied_model_measures_what_it_saves(tmp_path):
    """A tied head tuned: in memory the input embedding is the tuned head too, as in the saved
    (tied) checkpoint; a head trained apart from the embedding would measure one model and save another."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=True)).eval()
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    method = build_method("tune-last", {"layers": "1"})
    method.prepare(HealContext(model=model, layers=(2,), calibration=lambda tokens: [ids]))
    with torch.no_grad():
        method.head.add_(0.5 * torch.randn_like(method.head))  # as training would move it
    assert method.tied
    healed = Healed(model, (2,), method)
    with healed.as_model("healed") as m:
        measured = _logits(m, ids)
    healed.save(None, tmp_path / "hf")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert saved.config.tie_word_embeddings and saved.lm_head.weight is saved.model.embed_tokens.weight
    torch.testing.assert_close(_logits(saved, ids), measured, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- what a result reports
def _suite_result(avg_parts: dict[str, float]) -> dict:
    return {"task": {"metric": "average", "metrics": {**avg_parts, "average": sum(avg_parts.values()) / len(avg_parts)},
                     "data": "commonsense", "member_metrics": {k: "acc" for k in avg_parts}}}


@pytest.mark.statistics
def test_retained_is_the_share_of_the_unpruned_average():
    from depthcurse.heal.shares import retained

    unpruned = retained(_suite_result({"arc_easy": 0.6, "piqa": 0.8}), None)
    pruned = retained(_suite_result({"arc_easy": 0.3, "piqa": 0.6}), unpruned)
    assert unpruned["task"]["metrics"]["retained"] == 1.0
    assert pruned["task"]["metrics"]["retained"] == pytest.approx(0.45 / 0.7)


@pytest.mark.statistics
def test_the_model_index_lists_the_healed_model_one_entry_per_task_and_retained_in_percent():
    """The hub's form: each task of a suite its own dataset with its headline metric, the suite's
    average and retained (in percent, as the tables say it), the held-out text's loss; every number
    the healed model's, not the pruned or unpruned one's."""
    from depthcurse.card import card_text
    import yaml

    from depthcurse.heal.model_index import evaluation_results

    def model(arc, piqa, loss):
        return {**_suite_result({"arc_easy": arc, "piqa": piqa}), "held_out": {"metric": "loss", "metrics": {"loss": loss, "ppl": math.exp(loss)},
                                                                                "data": "wiki (held out)"}}

    record = {"results": {"unpruned": model(0.6, 0.8, 3.0), "pruned": model(0.3, 0.6, 4.0), "healed": model(0.5, 0.7, 3.5)}}
    record["results"]["healed"]["task"]["metrics"]["retained"] = 0.6 / 0.7
    entries = evaluation_results(record)
    by = {(e["dataset"], e["metric"]): e["value"] for e in entries}
    assert by[("arc_easy", "acc")] == 0.5 and by[("piqa", "acc")] == 0.7 and by[("commonsense", "average")] == pytest.approx(0.6)
    assert by[("commonsense", "retained %")] == pytest.approx(100 * 0.6 / 0.7) and by[("wiki (held out)", "loss")] == 3.5
    text = card_text({"made_by": "depthcurse heal", "model": "m", "n_layers": 4, "removed_layers": [2], "layers_left": 3, "why": "by hand",
                      "command": "depthcurse heal m", "evaluation": entries})
    index = yaml.safe_load(text.split("---")[1])["model-index"][0]["results"]
    assert sorted(r["dataset"]["name"] for r in index) == ["arc_easy", "commonsense", "piqa", "wiki (held out)"]  # one entry per task


def test_the_card_of_an_outside_method_says_how_to_make_it_again_and_what_it_cost(bos_model_dir, docs_file, tmp_path):
    plugin = tmp_path / "diag_scale.py"
    plugin.write_text(DIAG + '''
    def applied(self, model):
        import contextlib
        return contextlib.nullcontext(model)
''')
    spec = f"{plugin}:DiagScale"
    heal(load_model(str(bos_model_dir)), _cfg(docs_file, method=spec), tmp_path / "diag")
    card = (tmp_path / "diag" / "hf" / "README.md").read_text()
    assert f"(`--method {spec}`)" in card and "diag-scale is not one of depthcurse's methods" in card
    assert re.search(r"\*\*What it cost:\*\* [\d.,]+ s, [\d,]+ tokens", card)
    assert f"--method {spec}" in card.split("## Made with")[1]


def test_a_suite_scores_each_task_by_its_headline_not_its_last_metric():
    from depthcurse.tasks.harness import LmEvalTask

    task = object.__new__(LmEvalTask)
    task.members = ("arc_easy", "piqa")
    task.member_metrics = {"arc_easy": "acc", "piqa": "acc"}
    task.groups = {}
    task.loaded = {"tasks": {"arc_easy": None, "piqa": None}}
    results = {"results": {"arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.9},
                           "piqa": {"acc,none": 0.7, "acc_norm,none": 0.1}}, "n-samples": {"arc_easy": {"effective": 3}, "piqa": {"effective": 3}}}
    score = task._suite_score(results)
    assert score.metrics["arc_easy"] == 0.5 and score.metrics["piqa"] == 0.7 and score.metrics["average"] == pytest.approx(0.6)


def test_a_new_layer_in_a_removed_place_is_traced_to_no_source_layer():
    from depthcurse.card import provenance
    from depthcurse.loading import LoadedModel

    loaded = LoadedModel(model=None, tokenizer=None, name="meta-llama/Llama-2-7b-hf", source="meta-llama/Llama-2-7b-hf", dtype=torch.float32,
                         device=torch.device("cpu"))
    record = provenance(loaded, [2, 3], 6, why="by hand", made_by="depthcurse heal", command="c", layers_left=5, new_at=(2,))
    assert record["layers_from"] == [0, 1, None, 4, 5]  # block 2 of the healed model is new, trained; block 3 was the source's 4


@pytest.mark.statistics
def test_the_noise_of_a_paired_mean_shrinks_as_one_over_root_n():
    from depthcurse.heal.intervals import paired_spread

    a = [1.0, 2.0, 4.0, 3.0, 5.0, 9.0, 2.0, 6.0]
    b = [0.5, 2.5, 3.0, 3.0, 4.0, 7.0, 2.5, 5.0]
    diff = [x - y for x, y in zip(a, b)]
    mean = sum(diff) / len(diff)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diff) / (len(diff) - 1))
    spread = paired_spread({"a": [a], "b": [b]}, {"a": 1.0, "b": -1.0})
    assert spread.se == pytest.approx(sd / math.sqrt(len(diff))) and spread.df == len(diff) - 1


# --------------------------------------------------------------------------- speed's verdicts and stopping
@pytest.mark.statistics
def test_speed_calls_a_ratio_impossible_only_when_its_whole_interval_is_above_one():
    from depthcurse.speed.paired import PairedRatio, Shares, judge

    shares = Shares(layers=0.7, arithmetic=0.75, bytes=0.8)
    above = judge(PairedRatio([1.05, 1.06, 1.07, 1.08, 1.09, 1.1]), shares, ceiling=1.0)
    assert above.status == "impossible"
    straddles = judge(PairedRatio([0.9, 0.95, 0.98, 1.02, 1.05, 1.1]), shares, ceiling=1.0)
    assert straddles.status == "unstable" and "reaches 1.000x" in straddles.reason


@pytest.mark.statistics
def test_speed_stops_measuring_when_every_ratio_is_steady_not_any():
    from depthcurse.speed.paired import PairedRatio, enough

    steady, wide = PairedRatio([0.8] * 8), PairedRatio([0.5, 0.9, 0.6, 0.95, 0.55, 0.85, 0.7, 0.99])
    assert not enough([steady, wide], 8, 6, 40, 0.0, 300.0, tolerance=0.05)
    assert enough([steady, steady], 8, 6, 40, 0.0, 300.0, tolerance=0.05)


def test_each_decode_ratio_is_filed_under_its_own_batch_size():
    """A clock on which the pruned model's batch-3 decoding costs 1.5 times its blocks: the batch-1
    ratio is 4/6 and the batch-3 ratio 6/6, each under its own key."""
    from depthcurse.speed import SpeedConfig, measure_speed
    from depthcurse.surgery import find_blocks, removed_layers

    model = tiny_llama(300, layers=6)
    now = {"model": None, "rows": 0}

    @contextlib.contextmanager
    def named(name, inner):
        with inner as m:
            now["model"] = name
            yield m

    class Clock:
        def __init__(self):
            self.count = self.mark = 0
            for block in find_blocks(model).layers:
                block.register_forward_hook(lambda module, args, out: self.tick(args))

        def tick(self, args):
            self.count += 1
            now["rows"] = args[0].shape[0] if args else now["rows"]

        def start(self):
            self.mark = self.count

        def stop(self):
            blocks = float(self.count - self.mark)
            return blocks * (1.5 if now["model"] == "pruned" and now["rows"] == 3 else 1.0)

    from depthcurse.speed.measure import as_is

    cfg = SpeedConfig(prefill_batch=2, prefill_len=12, decode_batches=(1, 3), prompt_len=5, new_tokens=4, repeats=6, max_repeats=12, warmup=1)
    record = measure_speed({"unpruned": lambda: named("unpruned", as_is(model)), "pruned": lambda: named("pruned", removed_layers(model, (1, 4)))},
                           torch.device("cpu"), cfg, 300, clock=Clock())
    assert record["ratios"]["decode_time_b1"] == pytest.approx(4 / 6) and record["ratios"]["decode_time_b3"] == pytest.approx(1.0)
    assert record["ratios"]["prefill_time"] == pytest.approx(4 / 6)
