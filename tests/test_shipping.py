"""What a removal buys and a model you can ship: `speed`, the model card, peft adapters, the hub,
a budget instead of a count. Tiny models built here.

The references are independent of the code under test: a clock that counts the blocks run (so a
model against itself is exactly 1.0x and 4 of 6 layers exactly 4/6, with no timing in a test),
plain transformers and peft loading what was saved, YAML parsing the card, the pruned models'
losses computed here for the budget's answer.
"""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest
import torch

from helpers import built_without, held_out_windows, tiny_llama

from depthcurse.loading import load_model
from depthcurse.speed import SpeedConfig, measure_speed, speed_rows
from depthcurse.speed.measure import as_is
from depthcurse.surgery import find_blocks, removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = SpeedConfig(prefill_batch=2, prefill_len=12, decode_batches=(1, 3), prompt_len=5, new_tokens=4, repeats=6, max_repeats=12, warmup=1)
TIMED = ("prefill_time", "decode_time_b1", "decode_time_b3")


class BlockClock:
    """A clock whose 'seconds' are the blocks run between start and stop: the work, not the time."""

    def __init__(self, *models):
        self.count, self.mark = 0, 0
        for model in models:
            for block in find_blocks(model).layers:
                block.register_forward_hook(lambda *a: setattr(self, "count", self.count + 1))

    def start(self):
        self.mark = self.count

    def stop(self):
        return float(self.count - self.mark)


class AnyBlockClock(BlockClock):
    """The same, counting the blocks of every model, those loaded after it too (a global hook)."""

    def __init__(self):
        self.count, self.mark = 0, 0

    def __enter__(self):
        def count(module, args, output):
            if type(module).__name__.endswith("DecoderLayer"):
                self.count += 1

        self.handle = torch.nn.modules.module.register_module_forward_hook(count)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


class WarpedClock(BlockClock):
    """Blocks run, then bent by `warp(seconds, stops so far)`: a machine that changes while it measures."""

    def __init__(self, model, warp):
        super().__init__(model)
        self.warp, self.stops = warp, 0

    def stop(self):
        self.stops += 1
        return self.warp(super().stop(), self.stops)


def _speed(as_model, model, clock, cfg=SMALL):
    return measure_speed(as_model, torch.device("cpu"), cfg, 300, clock=clock)


def test_a_model_against_itself_is_one_and_four_of_six_layers_are_four_sixths():
    """The timed regions hold each model's own calls, the same work for both (prefill: one forward;
    decoding: one forward per new token), whoever goes first; every ratio is the quotient of the
    same run's figures; the deterministic figures are exact."""
    model = tiny_llama(300, layers=6)
    clock = BlockClock(model)
    itself = _speed({"unpruned": lambda: as_is(model), "pruned": lambda: as_is(model)}, model, clock)
    assert all(v == 1.0 for k, v in itself["ratios"].items() if k != "peak_memory_prefill") and all(v == 1.0 for v in itself["floor"].values())
    pruned = _speed({"unpruned": lambda: as_is(model), "pruned": lambda: removed_layers(model, (1, 4))}, model, clock)
    u, p, ratios = pruned["models"]["unpruned"], pruned["models"]["pruned"], pruned["ratios"]
    # steady from the first pairs: the fewest that give an interval, no more
    assert u["prefill"]["seconds"]["runs"] == [6.0] * 6 and p["prefill"]["seconds"]["runs"] == [4.0] * 6  # blocks per prefill
    assert u["decode"]["1"]["seconds_per_token"]["median"] == 6.0  # blocks per generated token
    for key in ("prefill_time", "decode_time_b1", "decode_time_b3"):
        assert ratios[key] == pytest.approx(4 / 6)
    assert ratios["prefill_tokens_per_s"] == pytest.approx(6 / 4)
    assert pruned["trusted"] and all(pruned["checks"][key]["status"] == "ok" and pruned["checks"][key]["interval"] == [4 / 6, 4 / 6] for key in TIMED)
    # a time that is all blocks sits on the layers' share, below the arithmetic's and the bytes' (the head stays)
    assert all(pruned["checks"][key]["regime"] == "layers" for key in TIMED)
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[1].parameters())
    assert (u["params"], p["params"]) == (params, params - 2 * block) and ratios["params"] == pytest.approx((params - 2 * block) / params)
    assert u["kv_bytes_per_token"] == 6 * 2 * 2 * 8 * 4 and ratios["kv_bytes_per_token"] == pytest.approx(4 / 6)  # layers x K,V x 2 heads x 8 x fp32
    shares = pruned["shares"]["prefill_time"]
    assert shares["layers"] == pytest.approx(4 / 6) and 4 / 6 < shares["arithmetic"] < 1 and 4 / 6 < shares["bytes"] < 1  # the head does not shrink
    assert pruned["floor"]["kv_bytes_per_token"] == pytest.approx(4 / 6) and pruned["floor"]["prefill_time"] == pytest.approx(4 / 6)
    assert [row[0].split(":")[0] for row in speed_rows(pruned)] == ["layers", "prefill, 2 x 12 tokens", "prefill", "decoding, batch 1, 4 tokens after 5",
                                                                    "decoding, batch 3, 4 tokens after 5", "parameters", "peak memory in prefill",
                                                                    "KV cache"]


def test_the_time_budget_holds_before_the_fewest_pairs_too():
    """Each measurement takes 10 s of a clock the test keeps: a pair (both models: a prefill and two
    decodings each) takes 60 s. With --max-seconds 150 it stops after the second pair, since a third
    would end at 180 s: within the budget, though 6 pairs were asked (it ran 6 pairs whatever the
    budget before), and the verdict says the pairs are too few for an interval."""
    model = tiny_llama(300, layers=6)
    as_model = {"unpruned": lambda: as_is(model), "pruned": lambda: removed_layers(model, (1, 4))}
    elapsed = [0.0]

    class TenSeconds(BlockClock):
        def stop(self):
            super().stop()
            elapsed[0] += 10.0
            return 10.0

    cfg = dataclasses.replace(SMALL, max_seconds=150.0)
    record = measure_speed(as_model, torch.device("cpu"), cfg, 300, clock=TenSeconds(model), now=lambda: elapsed[0])
    checks = record["checks"]
    assert all(c["pairs"] == 2 for c in checks.values()) and elapsed[0] - 60.0 <= 150.0  # the warm-up pair is not measuring
    assert all(c["status"] == "unstable" and "pairs give no 95% interval" in c["reason"] for c in checks.values())
    assert record["wall_time_s"] == elapsed[0] and {"command", "packages"} <= set(record["environment"])  # by the clock the test holds (issue 90)


def test_a_timing_that_cannot_be_trusted_says_so():
    """Pairs cancel a machine that drifts between them; one that jumps gives a wide interval,
    flagged unstable; a ratio below the layers' share, or above 1, is flagged impossible. The
    references are the clocks' own arithmetic."""
    model = tiny_llama(300, layers=6)
    as_model = {"unpruned": lambda: as_is(model), "pruned": lambda: removed_layers(model, (1, 4))}
    per_round = 2 * len(TIMED)  # measurements a round takes: each model's prefill and decodings

    def drifting(seconds, stops):  # 30% slower every round: the ratio of two medians would move, a pair's does not
        return seconds * 1.3 ** ((stops - 1) // per_round)

    steady = _speed(as_model, model, WarpedClock(model, drifting))
    assert steady["trusted"] and all(steady["ratios"][key] == pytest.approx(4 / 6) for key in TIMED)
    assert steady["checks"]["prefill_time"]["pairs"] == 6

    def jumping(seconds, stops):  # another job takes the machine for every fifth measurement
        return seconds * (8 if stops % 5 == 0 else 1)

    jumped = _speed(as_model, model, WarpedClock(model, jumping))
    flagged = {key: c["status"] for key, c in jumped["checks"].items() if c["status"] != "ok"}
    assert not jumped["trusted"] and set(flagged.values()) == {"unstable"}
    assert all(jumped["checks"][key]["pairs"] == SMALL.max_repeats for key in TIMED)  # it tried until the budget of pairs

    below = _speed(as_model, model, WarpedClock(model, lambda seconds, stops: seconds**2))  # pruned 16 against 36: 0.44x < 4/6 of the layers
    assert all(below["checks"][key]["status"] == "impossible" for key in TIMED) and not below["trusted"]
    assert "below 0.667x, the share of the layers kept" in below["checks"]["prefill_time"]["reason"]
    slower = _speed(as_model, model, WarpedClock(model, lambda seconds, stops: 1000 - seconds))  # the pruned model 'slower'
    assert all(slower["checks"][key]["status"] == "impossible" for key in TIMED) and "measured slower" in slower["checks"]["decode_time_b1"]["reason"]


@pytest.mark.statistics
def test_the_median_interval_is_the_binomial_order_statistics():
    """Against an independent count: for each n, the interval's coverage computed by brute force
    over every sign pattern of n values around the median."""
    import itertools

    from depthcurse.speed.paired import median_interval

    assert median_interval([1.0] * 5) is None  # 2 / 2**5 > 5%: five values cannot bound the median at 95%
    for n in (6, 9, 14):
        xs = [float(i) for i in range(n)]
        lo, hi = median_interval(xs)
        k = int(lo) + 1  # 1-based order statistic
        assert hi == xs[n - k]
        # P(fewer than k values below the median, or fewer than k above): the interval misses it
        miss = sum(1 for signs in itertools.product((0, 1), repeat=n) if sum(signs) < k or n - sum(signs) < k) / 2**n
        assert miss <= 0.05
        wider_miss = sum(1 for signs in itertools.product((0, 1), repeat=n) if sum(signs) < k + 1 or n - sum(signs) < k + 1) / 2**n
        assert wider_miss > 0.05  # and it is the tightest such interval


def test_speed_on_the_command_line_measures_a_checkpoint_against_its_source(run_cli, tiny_model_dir, tmp_path):
    """The CLI's record; its card gets the table only from a result that passed the checks: two
    pairs (no interval) leave it as it was, a steady run (blocks counted) writes it."""
    from depthcurse.report import write_report
    from depthcurse.speed import speed_checkpoint

    code, stdout, err = run_cli("drop", tiny_model_dir, "--layers", "1,2", "--out", tmp_path / "dropped")
    assert code == 0, err
    # --max-seconds 0: one pair and no more (a second would end past the budget), too few for an interval
    code, stdout, err = run_cli("speed", tmp_path / "dropped", "--max-seconds", "0", "--prefill-len", "16", "--prompt-len", "4",
                                "--new-tokens", "3", "--decode-batches", "1,2", "--out", tmp_path / "speed")
    assert code == 0, err
    record = json.loads((tmp_path / "speed" / "speed.json").read_text())
    models = record["models"]
    assert (models["unpruned"]["layers"], models["pruned"]["layers"]) == (4, 2) and record["run"]["removed"] == [1, 2]
    for name in ("unpruned", "pruned"):
        assert models[name]["prefill"]["tokens_per_s"] > 0 and len(models[name]["prefill"]["seconds"]["runs"]) == 1
        assert set(models[name]["decode"]) == {"1", "2"} and models[name]["prefill"]["peak_rise_bytes"] >= 0
    assert "what the removal buys" in " ".join(stdout.split()) and "NOT TRUSTED" in " ".join(stdout.split())
    assert not record["trusted"] and record["card"] is None and record["checks"]["prefill_time"]["status"] == "unstable"
    assert "not a finding, prefill time: unstable: 1 pair gives no 95% interval" in " ".join(err.split()) and "model card was left" in err
    card = (tmp_path / "dropped" / "README.md").read_text()
    assert "## What the removal buys" not in card
    assert "**Computed in:** float32 (auto: the checkpoint's own dtype): the measurements below" in card  # drop keeps what it loaded
    cfg = SpeedConfig(prefill_len=16, prompt_len=4, new_tokens=3, decode_batches=(1, 2), max_repeats=6)
    with AnyBlockClock() as clock:
        steady = speed_checkpoint(tmp_path / "dropped", tmp_path / "speed", cfg, device="cpu", clock=clock)
    assert steady["trusted"] and steady["card"] == str(tmp_path / "dropped" / "README.md") and steady["ratios"]["decode_time_b2"] == 0.5
    card = (tmp_path / "dropped" / "README.md").read_text()
    assert "## What the removal buys" in card and "KV cache: bytes per token" in card and "near the layers share" in card
    page = write_report([tmp_path / "speed"], tmp_path / "page.md").read_text()
    assert "## What a removal buys" in page and "prefill" in page
    from depthcurse.io import environment  # how it was made: this process's command, commit, versions and machine (issue 90)

    env = environment()
    made = page[page.index("## How each was made"):]
    assert f"`{tmp_path / 'speed'}`" in made and f"`{env['command']}`" in made and f"torch {env['packages']['torch']}" in made and env["cpu"] in made
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "speed.json").write_text(json.dumps({**steady, "environment": None}))
    assert write_report([tmp_path / "old"], tmp_path / "old.md").read_text().count("(not kept: a record from before issue 90)") == 1


def test_speeds_bad_inputs_get_one_line(run_cli, tiny_model_dir, tmp_path):
    from helpers import assert_one_line_error

    code, _, err = run_cli("drop", tiny_model_dir, "--layers", "1", "--out", tmp_path / "dropped")
    assert code == 0, err
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--out", tmp_path / "a"), "give --layers L (removed in memory), or a checkpoint drop or heal made")
    assert_one_line_error(*run_cli("speed", tmp_path / "dropped", "--layers", "2", "--out", tmp_path / "b"), "without layers 1: it is measured against the model it came from")
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--layers", "0-3", "--out", tmp_path / "c"), "--layers 0-3 removes all 4 layers")
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--layers", "1", "--repeats", "0"), "--repeats must be at least 6, the fewest pairs a 95% interval of the median rests on, got 0")
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--layers", "1", "--decode-batches", "1,x"), "--decode-batches '1,x': give batch sizes, e.g. 1,8")
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--layers", "1", "--decode-batches", "0"), "--decode-batches must be batch sizes of at least 1, got 0")
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--layers", "1", "--repeats", "8", "--max-repeats", "6"), "--max-repeats must be at least --repeats (8), got 6")
    assert_one_line_error(*run_cli("speed", tiny_model_dir, "--layers", "1", "--tolerance", "0"), "--tolerance must be above 0 and --max-seconds 0 or more")


def _front_matter(path: Path) -> dict:
    import yaml

    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---", 2)[1])


def test_the_card_front_matter_is_yaml_naming_the_base_model_and_the_removed_layers(tmp_path):
    from depthcurse.card import card_text, provenance
    from depthcurse.loading import LoadedModel

    loaded = LoadedModel(model=None, tokenizer=None, name="smollm2-135m", source=str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    record = provenance(loaded, [12, 13, 14, 15], 30, why="the first 4 layers of the angular blocks of runs/angular", made_by="depthcurse heal",
                        command="depthcurse heal smollm2-135m --layers 12,13,14,15", healing={"method": "linear", "data": "wiki", "calib_tokens": 16384})
    (tmp_path / "README.md").write_text(card_text({**record, "measured": [("model", "held-out ppl"), ("unpruned", "17.3"), ("healed", "20.5")]}))
    front = _front_matter(tmp_path / "README.md")
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0" and front["library_name"] == "transformers"
    assert front["depthcurse"]["removed_layers"] == [12, 13, 14, 15] and front["depthcurse"]["layers_left"] == 26 and "healed" in front["tags"]
    body = (tmp_path / "README.md").read_text()
    assert "without layers 12-15" in body and "angular blocks of runs/angular" in body and "| healed | 20.5 |" in body
    assert "depthcurse heal smollm2-135m --layers 12,13,14,15" in body
    # the alias's offline copy is not the hub's checkpoint its base_model names, and the card says so
    from depthcurse.assets import MODEL_ALIASES

    offline = LoadedModel(model=None, tokenizer=None, name="smollm2-135m", source=str(MODEL_ALIASES["smollm2-135m"].local_path()), dtype=torch.float32,
                          device=torch.device("cpu"))
    note = card_text(provenance(offline, [3], 30, why="by hand", made_by="depthcurse drop", command="depthcurse drop smollm2-135m --layers 3"))
    assert "**The weights:** Offline copy dequantised from the Q4_1 GGUF" in note and "**The weights:**" not in body


def test_heal_saves_peft_adapters_that_load_on_drops_checkpoint_to_the_merged_model(run_cli, bos_model_dir, docs_file, tmp_path):
    """`adapters/` in peft's format, numbered for the pruned model: PeftModel.from_pretrained on
    `drop`'s checkpoint of the same removal gives hf/'s logits; the card says how it was made."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from depthcurse.heal import HealConfig, heal

    out = tmp_path / "run"
    heal(load_model(str(bos_model_dir)), HealConfig(layers=(1, 3), data=str(docs_file), steps=4, batch_size=4, seq_len=24, lr=5e-3, eval_windows=2,
                                                    method_args={"lora_rank": 4, "lora_dropout": 0.0}), out)
    code, _, err = run_cli("drop", bos_model_dir, "--layers", "1,3", "--out", tmp_path / "dropped")
    assert code == 0, err
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "dropped"), out / "hf" / "adapters").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ids = torch.randint(3, 300, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-5)
    front = _front_matter(out / "hf" / "README.md")
    assert front["depthcurse"]["removed_layers"] == [1, 3] and front["depthcurse"]["method"] == "lora" and "base_model" not in front  # a local folder
    made = json.loads((out / "hf" / "depthcurse.json").read_text())
    assert made["command"].startswith(f"depthcurse heal {bos_model_dir} --layers 1,3 --method lora") and made["healing"]["files"]["adapters"] == "adapters"
    # the adapters name no base model: the unpruned one is not theirs, and AutoPeftModel must not load them onto it
    assert json.loads((out / "hf" / "adapters" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    adapter_card = _front_matter(out / "hf" / "adapters" / "README.md")
    assert adapter_card["library_name"] == "peft" and "base_model" not in adapter_card
    assert "without layers 1,3" in (out / "hf" / "adapters" / "README.md").read_text() and str(bos_model_dir) not in str(adapter_card)


def test_the_folder_handed_to_the_hub_is_complete_and_no_hub_is_one_line(run_cli, bos_model_dir, docs_file, tmp_path, monkeypatch):
    import depthcurse.hub as hub
    from huggingface_hub import HfApi

    handed = {}
    monkeypatch.setattr(hub.assets, "hub_reachable", lambda: True)
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo, **kw: handed.setdefault("created", (repo, kw)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, folder_path, repo_id, **kw: handed.update(
        {repo_id: sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())}))
    base = ["heal", bos_model_dir, "--layers", "2", "--calibration", docs_file, "--steps", "2", "--batch-size", "2", "--seq-len", "24", "--eval-windows", "2",
            "--lora-rank", "2"]
    code, _, err = run_cli(*base, "--out", tmp_path / "run", "--push-to-hub", "me/healed", "--private")
    assert code == 0, err
    assert handed["created"] == ("me/healed", {"private": True, "exist_ok": True})
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "depthcurse.json", "adapters/adapter_config.json",
            "adapters/adapter_model.safetensors"} <= set(handed["me/healed"])
    code, _, err = run_cli("drop", bos_model_dir, "--layers", "2", "--out", tmp_path / "dropped", "--push-to-hub", "me/dropped")
    assert code == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "depthcurse.json"} <= set(handed["me/dropped"])

    monkeypatch.setattr(hub.assets, "hub_reachable", lambda: False)  # as on the machines we build on
    code, stdout, err = run_cli("drop", bos_model_dir, "--layers", "2", "--out", tmp_path / "kept", "--push-to-hub", "me/kept")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("error: cannot push to the hub repository me/kept: the hub is not reachable") and "kept in" in lines[0]
    assert (tmp_path / "kept" / "model.safetensors").is_file()  # the local folder stays


def _trained_tiny(tokenizer, docs_file, path: Path, layers: int = 6, steps: int = 150) -> Path:
    """A tiny Llama trained here on the documents (plain next-token loss, Adam): unlike a random
    one, it loses more the more of its layers go."""
    from depthcurse.text import load_texts

    model = tiny_llama(len(tokenizer), layers=layers, seed=0).train()
    text = " ".join(load_texts(str(docs_file))[0])
    ids = torch.tensor(tokenizer(text)["input_ids"])
    rows = ids[: len(ids) // 24 * 24].view(-1, 24)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = rows[torch.randint(0, len(rows), (16,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_budget_picks_the_largest_k_within_it_by_bisection(bos_tokenizer, docs_file, tmp_path):
    """With a learning rate of 1e-12 the healed model is the pruned one, whose held-out loss per
    window at each k of the order is computed here; the budget falls between two of the losses, and
    a k is within it when the upper end of the 95% interval of its loss over the budget, paired
    over the windows (mean + t sd / sqrt(n) of healed - (1 + max_drop) unpruned, t = 3.182446 at the
    4 windows' 3 degrees of freedom), stays at or below 0: computed here, so the answer is known, the
    largest k within it with every smaller k."""
    import math

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from depthcurse.heal import HealConfig, heal_within, order_sets
    from depthcurse.prune import run_sweep
    from depthcurse.tasks import PerplexityTask

    model_dir = _trained_tiny(bos_tokenizer, docs_file, tmp_path / "trained")
    loaded = load_model(str(model_dir))
    run_sweep(loaded, PerplexityTask(loaded.tokenizer, [docs_file.read_text()], source="docs", seq_len=24, limit=4), range(6), tmp_path / "sweep")
    sets, source = order_sets(tmp_path / "sweep", None, 6)
    assert sorted(sets) == [1, 2, 3, 4, 5]
    windows = held_out_windows(loaded.tokenizer, docs_file, 24, 4)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def per_window(layers):
        model = built_without(reference, "model.layers", list(layers)) if layers else reference
        with torch.no_grad():
            logits = model(input_ids=windows).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(len(windows), -1).mean(1).tolist()

    base_windows = per_window(())
    base = sum(base_windows) / len(base_windows)
    windows_at = {k: per_window(layers) for k, layers in sets.items()}
    losses = {k: sum(w) / len(w) for k, w in windows_at.items()}
    split = [k for k in range(1, 5) if max(losses[j] for j in losses if j <= k) < min(losses[j] for j in losses if j > k)]
    assert split, losses  # trained, the model has a prefix of its order that costs less than every longer one
    point = split[-1]
    limit = (max(losses[j] for j in losses if j <= point) + min(losses[j] for j in losses if j > point)) / 2
    factor = limit / base

    def upper(k):
        z = [h - factor * u for h, u in zip(windows_at[k], base_windows)]
        mean = sum(z) / len(z)
        sd = math.sqrt(sum((v - mean) ** 2 for v in z) / (len(z) - 1))
        assert len(z) == 4
        return mean + 3.182446 * sd / math.sqrt(len(z))

    within = {k: upper(k) <= 0 for k in sorted(losses)}
    answer = max([k for k in within if all(within[j] for j in within if j <= k)], default=0)
    assert all(within[j] for j in within if j <= answer) and not any(within[j] for j in within if j > answer), within  # a prefix
    assert not within[point] or answer == point  # the interval is stricter than the point: never a larger k
    cfg = HealConfig(layers=(), data=str(docs_file), steps=1, batch_size=2, seq_len=24, lr=1e-12, eval_windows=4, method_args={"lora_rank": 2})
    record = heal_within(loaded, lambda: load_model(str(model_dir)), cfg, sets, source, tmp_path / "within", factor - 1)
    budget = record["budget"]
    assert budget["chosen"] == answer, (losses, base, within, budget)
    assert len(budget["probes"]) <= 3 and [p["k"] for p in record["points"]] == sorted(p["k"] for p in budget["probes"])  # log2(5 + 1), not 5 heals
    assert all(p["healed_loss"] == pytest.approx(losses[p["k"]], rel=1e-5) for p in budget["probes"])
    assert all(p["healed_loss_upper"] == pytest.approx(upper(p["k"]) + limit, rel=1e-5) for p in budget["probes"])
    above = [p["k"] for p in budget["probes"] if p["k"] > answer]
    assert (f"k = {answer}" in budget["why"] if answer else "no k of the order" in budget["why"]) and (not above or f"k = {min(above)} is not" in budget["why"])
    again = heal_within(loaded, lambda: load_model(str(model_dir)), cfg, sets, source, tmp_path / "within", factor - 1)
    assert again["budget"] == budget  # every heal found made, none made again


def test_shares_of_the_depth_and_the_budget_bad_inputs(run_cli, bos_model_dir, docs_file, tmp_path):
    from helpers import assert_one_line_error

    from depthcurse.heal import parse_ks, parse_share

    assert parse_ks("25%,2", 30) == [2, 8] and parse_ks("100%", 5) == [5] and parse_ks("1%", 30) == [1]
    assert parse_share("5%") == pytest.approx(0.05) and parse_share("0.05") == pytest.approx(0.05)
    base = ["heal", bos_model_dir, "--calibration", docs_file, "--steps", "1", "--batch-size", "2", "--seq-len", "24", "--eval-windows", "2"]
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--max-drop", "5%"), "--max-drop searches an order for the largest k within the budget: give --order DIR")
    assert_one_line_error(*run_cli(*base, "--order", tmp_path, "--max-drop", "150%"), "--max-drop 150%: a share is more than 0% and at most 100%")
    assert_one_line_error(*run_cli(*base, "--order", tmp_path, "--ks", "150%"), "--ks 150%: a share of the depth is more than 0% and at most 100%")
    assert_one_line_error(*run_cli(*base, "--order", tmp_path), "--order DIR takes --ks K,K,... (a healed depth curve) or --max-drop 5%")
    assert_one_line_error(*run_cli(*base, "--layers", "1", "--push-to-hub", "me/has spaces"), "--push-to-hub 'me/has spaces' is not a hub repository name")
    assert_one_line_error(*run_cli("drop", bos_model_dir, "--layers", "1", "--out", tmp_path / "d", "--push-to-hub", "a b"), "--push-to-hub 'a b' is not a hub repository name")
    assert_one_line_error(*run_cli(*base, "--order", tmp_path, "--ks", "2", "--speed"), "--speed and --push-to-hub take the one healed checkpoint of --layers L")
    assert_one_line_error(*run_cli("speed", bos_model_dir), "give --layers L (removed in memory), or a checkpoint drop or heal made")
    assert_one_line_error(*run_cli("speed", bos_model_dir, "--layers", "1", "--repeats", "0"), "--repeats must be at least 6, the fewest pairs a 95% interval of the median rests on, got 0")


@pytest.mark.statistics
def test_an_interval_wholly_between_the_floor_and_one_is_a_finding_however_wide():
    """Bounded by the layers' share (the floor) and 1, the interval decides: 0.75-0.85 over 6 pairs
    (+-6%, wider than the tolerance) is a speed-up of 15-25%, said with its width; one reaching 1 or
    crossing the floor is not a finding; the tolerance only says when to stop measuring."""
    from depthcurse.speed.paired import PairedRatio, Shares, enough, judge

    shares = Shares(layers=0.7, arithmetic=0.8, bytes=0.85)
    wide = PairedRatio([0.75, 0.78, 0.80, 0.80, 0.82, 0.85])
    verdict = judge(wide, shares, ceiling=1.0, tolerance=0.05)
    assert verdict.status == "ok" and "15% to 25% less" in verdict.reason and "+-" in verdict.reason and verdict.regime == "arithmetic"
    assert not enough([wide], 6, 6, 40, 0.0, 300.0, tolerance=0.05)  # not steady: measuring goes on
    assert judge(PairedRatio([0.8, 0.85, 0.9, 0.95, 0.98, 1.01]), shares, ceiling=1.0).status == "unstable"  # reaches 1
    assert "crosses 0.700x" in judge(PairedRatio([0.65, 0.7, 0.72, 0.75, 0.78, 0.8]), shares, ceiling=1.0).reason
