"""One identity for kept state (`kept_state`, issue 88): every resumable job keys what it keeps by its
whole config and a digest of its inputs. These tests walk every field of every such config and every
parameter of every such call, and show that changing any of them is a different identity, which
refuses (or does not take up) the kept state; a field added later is walked without editing them."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama

from depthcurse import vocab_scores
from depthcurse.depth.csordas_map import MapSettings
from depthcurse.depth.definitions import DEFINITIONS
from depthcurse.depth.depth_map import depth_map
from depthcurse.depth.measure import measure_depth_use, stepper_of
from depthcurse.depth.tuned_lens import LensSettings, TunedLens, fingerprint, train_tuned_lens
from depthcurse.errors import DepthcurseError
from depthcurse.heal.config import RESUMABLE_CHANGES, HealConfig
from depthcurse.io import refuse_other_run
from depthcurse.kept_state import HEARD, call_identity, identity_of, module_digest, plain, tensors_digest
from depthcurse.runtime import World
from depthcurse.select.config import SelectConfig
from depthcurse.speculate.run import SpeculateConfig

# one torch thread: tiny models gain nothing from more, and mutmut forks this process (a thread pool forked is a deadlock)
pytestmark = [pytest.mark.instruments, pytest.mark.usefixtures("one_torch_thread")]


def other(value):
    """Another value of a scalar field's type, as a user might give it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if value is None:
        return 3
    if isinstance(value, tuple):
        return (*value, *value[:1]) if value else (1,)
    if isinstance(value, dict):
        return {**value, "other": 1}
    if dataclasses.is_dataclass(value):  # the first field changed: each nested field is walked apart (`_nested`)
        first = dataclasses.fields(value)[0].name
        return dataclasses.replace(value, **{first: other(getattr(value, first))})
    raise AssertionError(f"no other value for {type(value).__name__}: give this field one in the test")


def _nested(name, value):
    """(label, another value) for each field of a nested settings dataclass, or the value's other."""
    if dataclasses.is_dataclass(value) and not isinstance(value, World):
        return [(f"{name}.{f.name}", dataclasses.replace(value, **{f.name: other(getattr(value, f.name))})) for f in dataclasses.fields(value)]
    return [(name, other(value))]


# ---------------------------------------------------------------- the identity itself


def test_plain_keeps_what_a_round_trip_compares_and_refuses_what_it_cannot_say():
    @dataclasses.dataclass
    class Inner:
        x: tuple = (1, 2)

    assert plain({"a": (1, Inner()), "b": float("nan"), "c": float("inf"), "d": Path("x/y"), "e": frozenset({3, 1})}) == \
        {"a": [1, {"x": [1, 2]}], "b": "nan", "c": "inf", "d": "x/y", "e": [1, 3]}
    assert json.loads(json.dumps(plain({"b": float("nan")}))) == plain({"b": float("nan")})  # NaN's name, so a kept NaN equals itself
    ones = torch.ones(3)
    assert plain(ones)["shape"] == [3] and plain(ones) != plain(ones.bfloat16()) and plain(ones)["sha256"] == tensors_digest(ones)
    assert tensors_digest(torch.tensor([1, 2])) != tensors_digest(torch.tensor([2, 1]))
    with pytest.raises(TypeError, match="object has no identity"):
        plain(object())
    assert plain(World(rank=1, size=2)) == {"rank": 1, "size": 2, "parallel": None, "owns_group": False}


def test_a_models_digest_tells_another_checkpoint_dtype_and_one_changed_layer():
    a, b = tiny_llama(50, layers=2, seed=0), tiny_llama(50, layers=2, seed=1)
    assert module_digest(a) == module_digest(tiny_llama(50, layers=2, seed=0)) != module_digest(b)
    assert module_digest(a) != module_digest(tiny_llama(50, layers=2, seed=0).bfloat16())
    changed = tiny_llama(50, layers=2, seed=0)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.add_(1e-3)  # one matrix of the last layer, every element of it
    assert module_digest(changed) != module_digest(a)
    assert plain(a) == {"module": "LlamaForCausalLM", "sha256": module_digest(a)}


# ---------------------------------------------------------------- every config field


CONFIGS = {
    "select": (SelectConfig(k=2, calibration=("wiki",)), {"resamples", "seeds"}),  # they add to a run: a finished run may be given more
    "heal": (HealConfig(layers=(1, 2), method="linear"), RESUMABLE_CHANGES),  # how often it saves, logs and reports
    "speculate": (SpeculateConfig(skip=(1,)), frozenset()),
}
ODD = {"heal": {"method_args": {"ridge": 0.5}, "method": "lora", "layers": (1, 3)},  # values the config's identity can build a method from
       "select": {"calibration": ("wiki", "code")}, "speculate": {"skip": (2,), "also": ((3,),)}}


@pytest.mark.parametrize("job", CONFIGS)
def test_every_field_of_a_jobs_config_is_its_identity_and_another_value_refuses_the_kept_run(job, tmp_path):
    """select, heal and speculate: each field set to another value than the base's is a different run
    (`refuse_other_run`'s one line names it); the fields a job leaves out are exactly those it names."""
    base, left = CONFIGS[job]
    walked = 0
    for f in dataclasses.fields(base):
        value = ODD[job].get(f.name, other(getattr(base, f.name)))
        changed = dataclasses.replace(base, **{f.name: value})
        if f.name in left:
            assert changed.identity() == base.identity(), f.name
            continue
        with pytest.raises(DepthcurseError, match="holds a different"):
            refuse_other_run(tmp_path, base.identity(), changed.identity(), ignore=left)
        walked += 1
    assert walked == len(dataclasses.fields(base)) - len(left) and walked >= 11
    assert json.loads(json.dumps(base.identity())) == base.identity()  # what select.json, heal.json and speculate.json keep reads back equal


# ---------------------------------------------------------------- every argument of a call


def _ids(windows, length=10, seed=0):
    return torch.randint(3, 300, (windows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    shallow, deep = tiny_llama(300, layers=3, seed=5).eval(), tiny_llama(300, layers=4, seed=6).eval()
    lens = TunedLens(32, 3, fingerprint(stepper_of(shallow)))
    return shallow, deep, lens


def _calls(models):
    """Each resumable call of the depth instruments: its function, the arguments it is called with,
    what it leaves out and why, and the values a walk cannot make by `other`."""
    shallow, deep, lens = models
    another = tiny_llama(300, layers=3, seed=7).eval()
    return {
        "depth-use's batches": (measure_depth_use, dict(model=shallow, windows=_ids(4), batch_size=2, tuned=lens), frozenset(),
                                {"model": another, "windows": _ids(4, seed=1), "tuned": None, "definitions": DEFINITIONS["csordas"],
                                 "world": World(rank=0, size=2)}),
        "the tuned lens's training": (train_tuned_lens, dict(model=shallow, stepper=stepper_of(shallow), windows=_ids(4), settings=LensSettings(steps=2, tokens_per_step=20, micro_batch=2)),
                                      frozenset({"stepper"}), {"model": another, "windows": _ids(4, seed=1)}),
        "depth-map's rows": (depth_map, dict(shallow=shallow, deep=deep, fit_windows=_ids(4), held_windows=_ids(2, seed=2), batch_size=2),
                             frozenset(), {"shallow": another, "deep": tiny_llama(300, layers=4, seed=8), "fit_windows": _ids(4, seed=3),
                                           "held_windows": _ids(2, seed=4), "definitions": "csordas", "score": "r2_dims"}),
    }


@pytest.mark.parametrize("call", ["depth-use's batches", "the tuned lens's training", "depth-map's rows"])
def test_every_argument_of_a_resumable_call_is_its_identity(call, models):
    """Every parameter of the call's signature but how it is heard and kept (`HEARD`) and what it
    names apart is in its identity, a nested settings object field by field: another value of any is
    another identity. A parameter added to the function is walked here without an edit."""
    fn, given, left, odd = _calls(models)[call]
    arguments = inspect.signature(fn).bind_partial(**given)
    arguments.apply_defaults()
    base = call_identity(fn, arguments.arguments, leave_out=left)
    walked = []
    for name in inspect.signature(fn).parameters:
        if name in HEARD or name in left:
            continue
        for label, value in ([(name, odd[name])] if name in odd else _nested(name, arguments.arguments[name])):
            changed = call_identity(fn, {**arguments.arguments, name: value}, leave_out=left)
            assert changed != base, label
            walked.append(label)
    assert set(base) == {n for n in inspect.signature(fn).parameters if n not in HEARD | left}
    assert len(walked) >= 5


def test_each_depth_instrument_keeps_its_whole_calls_identity_and_a_rerun_of_another_takes_nothing_up(models, tmp_path):
    """Interrupted after its first step, each instrument's kept file holds the identity of its whole
    call (as `call_identity` makes it from the arguments); a rerun says what it took up; a rerun
    with any walked argument changed (definitions, windows, map settings) runs every step again."""
    steps = {"measure_depth_use": "the whole model's pass", "train_tuned_lens": "training the tuned lens", "depth_map": "maps from shallow layer"}
    for call, (fn, given, left, odd) in _calls(models).items():
        label = steps[fn.__name__]

        def stop_after_first(text, done, total):
            if text.startswith(label) and done == 1:
                raise KeyboardInterrupt

        kept = tmp_path / f"{fn.__name__}.kept"
        where = {"train_tuned_lens": "state"}.get(fn.__name__, "kept")
        with pytest.raises(KeyboardInterrupt):
            fn(**given, **{where: kept}, on_step=stop_after_first)
        arguments = inspect.signature(fn).bind_partial(**given)
        arguments.apply_defaults()
        expected = json.loads(json.dumps(call_identity(fn, arguments.arguments, leave_out=left)))
        if fn is train_tuned_lens:
            from safetensors import safe_open

            with safe_open(str(kept), "pt") as f:
                saved = json.loads(f.metadata()["identity"])
        else:
            saved = json.loads(kept.read_text())["identity"]
        assert saved == expected, call
        said, heard = [], []
        backup = kept.read_bytes()
        extra = {"on_note": said.append} if "on_note" in inspect.signature(fn).parameters else {}
        if fn is not depth_map:
            from depthcurse.forecast import Forecast

            extra["forecast"] = Forecast("steps", say=said.append)
        fn(**given, **{where: kept}, on_step=lambda t, d, n: heard.append(d) if t.startswith(label) else None, **extra)
        assert 0 not in heard and any("took up the 1 of" in line and str(kept) in line for line in said), (call, said, heard)
        changed = {"measure_depth_use": {"definitions": DEFINITIONS["csordas"]}, "train_tuned_lens": {"windows": _ids(4, seed=1)},
                   "depth_map": {"settings": MapSettings(seed=1)}}[fn.__name__]
        kept.write_bytes(backup)
        heard.clear()
        fn(**{**given, **changed}, **{where: kept}, on_step=lambda t, d, n: heard.append(d) if t.startswith(label) else None)
        assert 0 in heard, call  # another call's state: every step again


def test_select_and_speculate_key_their_records_by_their_inputs_too(tiny_model_dir, tmp_path):
    """Another text or prompts file under the same name, of the same shape, is another run: select's
    texts' windows and speculate's prompts' tokens are digested into the identity its record keeps."""
    from helpers import CORPUS

    from depthcurse.loading import load_model
    from depthcurse.select.grid import run_select
    from depthcurse.speculate import run_speculate

    loaded = load_model(str(tiny_model_dir))
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(CORPUS * 3))
    cfg = SelectConfig(k=1, calibration=(str(text),), searches=("last",), calib_windows=2, eval_windows=2, seq_len=8, resamples=0)
    run_select(loaded, cfg, tmp_path / "select")
    made = run_select(loaded, cfg, tmp_path / "select")  # the same text: taken up
    assert {"command", "commit", "cpu", "packages"} <= set(made["environment"]) and made["wall_time_s"] > 0  # how it was made (issue 90)
    assert made["vocabulary_scores"] == vocab_scores.status()  # what scored the logits
    text.write_text("\n\n".join(c[::-1] for c in CORPUS * 3))  # the same length and name, other tokens
    with pytest.raises(DepthcurseError, match="holds a different select run.*texts"):
        run_select(loaded, cfg, tmp_path / "select")

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the river flows\n\nwater boils at\n")
    spec = SpeculateConfig(skip=(1,), prompts=str(prompts), max_new_tokens=3, baselines=())
    run_speculate(loaded, spec, tmp_path / "spec")
    prompts.write_text("the river flown\n\nwater boils it\n")
    with pytest.raises(DepthcurseError, match="holds a different speculate run.*prompts_sha256"):
        run_speculate(loaded, spec, tmp_path / "spec")


def test_a_heal_runs_identity_holds_its_text_files_digest(tmp_path):
    """heal reads its calibration and other text by name: a file's bytes are in the identity (another
    file under the same name is another run), a named source's (wiki) are its name's."""
    from helpers import heal_config

    from depthcurse.heal.loop import identity
    from depthcurse.kept_state import file_digest
    from depthcurse.loading import LoadedModel

    text = tmp_path / "docs.txt"
    text.write_text("one document\n\nanother")
    loaded = LoadedModel(model=tiny_llama(50, layers=3), tokenizer=None, name="m", source="m", dtype=torch.float32, device=torch.device("cpu"))
    cfg = heal_config(layers=(1,), method="linear", data=str(text))
    first = identity(loaded, cfg)
    assert first["data_sha256"] == file_digest(str(text)) and first["eval_data_sha256"] is None
    text.write_text("one document\n\nanothex")
    again = identity(loaded, cfg)
    assert again["data_sha256"] == file_digest(str(text)) != first["data_sha256"]
    with pytest.raises(DepthcurseError, match="holds a different.*data_sha256"):
        refuse_other_run(tmp_path, first, again)
    assert identity(loaded, dataclasses.replace(cfg, data="wiki"))["data_sha256"] is None and file_digest(None) is None


def test_plain_on_an_enum_an_object_with_its_own_identity_a_tensors_fields_and_an_array_it_does_not_know():
    import enum
    import hashlib

    import numpy as np

    class Side(enum.Enum):
        LEFT = "left"

    class Named:
        def identity(self):
            return {"name": ("n", 1)}

    assert plain(Side.LEFT) == "left" and plain(Named()) == {"name": ["n", 1]}
    assert plain(torch.zeros(2, 3, dtype=torch.bfloat16)) == {"shape": [2, 3], "dtype": "bfloat16", "sha256": tensors_digest(torch.zeros(2, 3, dtype=torch.bfloat16))}
    assert tensors_digest(torch.zeros(0)) == hashlib.sha256(b"").hexdigest()[:16]  # an empty tensor adds no bytes
    assert len(tensors_digest(torch.ones(1))) == len(module_digest(tiny_llama(20, layers=1))) == 16
    with pytest.raises(TypeError, match="^ndarray has no identity for kept state"):
        plain(np.zeros(2))  # a shape but no torch tensor: not digested as one


def test_a_file_digest_is_its_bytes_and_sixteen_hex_digits(tmp_path):
    import hashlib

    from depthcurse.kept_state import file_digest

    (tmp_path / "t.txt").write_bytes(b"some text")
    assert file_digest(str(tmp_path / "t.txt")) == hashlib.sha256(b"some text").hexdigest()[:16]
    assert file_digest("wiki") is None and file_digest(str(tmp_path)) is None
