"""What several test modules share: tiny models built in the test, small texts, and checks.

Fixtures live in conftest.py; plain functions and data live here, imported by name
(`from helpers import tiny_llama`), so no test module imports another.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from depthcurse import kernel_build

CORPUS = [
    "The residual stream of a transformer grows with depth, and deep blocks change it little.",
    "Question: which layer can be removed?\nA. the first\nB. a middle one\nC. the last\nD. none\nAnswer: B",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "The following are multiple choice questions (with answers) about abstract algebra and anatomy.",
    "Find the degree for the given field extension Q(sqrt(2), sqrt(3)) over Q. 0 1 2 3 4 5 6 7 8 9",
]


QA_CORPUS = [
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "What is the capital of France? Which city is the capital of Germany? Who wrote the book?",
    "The river flows through the valley and the old town. The bridge was built in 1850 by engineers.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
]


FILLER = "The river flows through the valley and the old town. Water boils at one hundred degrees Celsius at sea level."
FACTS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome")]


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def needs(*packages: str):
    """Skip cleanly when a real offline asset package is not installed."""
    missing = [p for p in packages if not has_package(p)]
    return pytest.mark.skipif(bool(missing), reason=f"offline asset package(s) not installed: {', '.join(missing)}")


# a machine without a C++ compiler runs torch's paths: the C++ kernels' own tests need one
needs_compiler = pytest.mark.skipif(kernel_build.compiler() is None, reason="no C++ compiler on this machine")


def fresh_kernel_cache(monkeypatch, tmp_path, module, switch: str):
    """The body of a fixture: `module`'s kernel built anew into a cache of the test's own, its
    environment `switch` unset, and this process's kernel found again after."""
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(switch, raising=False)
    module.kernel.cache_clear()
    yield tmp_path
    module.kernel.cache_clear()


def tiny_llama(vocab_size: int, layers: int = 4, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, pad_token_id=2, bos_token_id=None)
    return LlamaForCausalLM(config).eval()


def tiny_bert(vocab_size: int, layers: int = 4, seed: int = 0, qa: bool = True):
    """A random Post-LN BERT, with a span head (BertForQuestionAnswering) or without (BertModel)."""
    from transformers import BertConfig, BertForQuestionAnswering, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64, max_position_embeddings=128, pad_token_id=0)
    return (BertForQuestionAnswering if qa else BertModel)(config).eval()


def squad_rows(n: int = 6, long: bool = False) -> list[dict]:
    """Questions whose answer is a city; with `long`, the answer sits after several filler
    sentences, beyond the first window of a short max_length."""
    rows = []
    for i in range(n):
        country, city = FACTS[i % len(FACTS)]
        pad = " ".join([FILLER] * (2 + i % 3)) if long else FILLER
        context = f"{pad} {city} is the capital of {country}. {FILLER} {i}"  # the number keeps paragraphs distinct
        rows.append({"id": f"q{i}", "title": "t", "context": context, "question": f"What is the capital of {country}?",
                     "answers": {"text": [city, f"{city} city"], "answer_start": [context.index(f"{city} is"), context.index(f"{city} is")]}})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_one_line_error(code, out, err, match):
    assert code != 0
    assert "Traceback" not in out + err
    assert "━" not in out + err, out  # no progress bar left behind: the error is the one line
    assert out == "", repr(out)  # nothing before it either: no header line, no table, not the blank line a bar ends with off a terminal
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and match in lines[0], lines[0]


def table_cells(table) -> list[list[str]]:
    """A rich table's cells as printed, row by row."""
    return [[column._cells[r] for column in table.columns] for r in range(table.row_count)]


def built_without(model, path, removed):
    """The independent reference for a pruned model: one built with n - k layers, the kept
    blocks' weights copied by renaming their keys (no depthcurse code involved)."""
    n = len(model.get_submodule(path))
    kept = [i for i in range(n) if i not in removed]
    new_of = {old: new for new, old in enumerate(kept)}
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    for name in ("layer_types", "mlp_layer_types", "no_rope_layers"):  # one entry per layer
        if getattr(config, name, None) is not None:
            setattr(config, name, [getattr(config, name)[i] for i in kept])
    for name in ("mlp_only_layers", "moe_layers"):  # lists of layer indices
        if getattr(config, name, None) is not None:
            setattr(config, name, [new_of[i] for i in getattr(config, name) if i in new_of])
    for name in ("first_k_dense_replace", "max_window_layers"):  # "the first k layers are special"
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, len([i for i in kept if i < getattr(config, name)]))
    ref = type(model)(config).eval()

    block_key = re.compile(rf"^{re.escape(path)}\.(\d+)\.(.*)$")
    state = {}
    for key, value in model.state_dict().items():
        m = block_key.match(key)
        if m is None:
            state[key] = value
        elif int(m.group(1)) in new_of:
            state[f"{path}.{new_of[int(m.group(1))]}.{m.group(2)}"] = value
    ref.load_state_dict(state, strict=True)
    return ref


def held_out_windows(tokenizer, docs_file, seq_len: int, count: int) -> torch.Tensor:
    """The held-out windows made here, not by `build_data`: the held-out documents tokenised one by
    one, joined with EOS and cut into BOS + seq_len - 1 tokens, as `prune --task ppl` cuts text."""
    from depthcurse.text import load_texts
    from depthcurse.train.data import _split_docs

    _, val_texts = _split_docs(load_texts(str(docs_file))[0])
    stream = [t for text in val_texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    body = seq_len - 1
    assert len(stream) >= count * body
    return torch.tensor([[tokenizer.bos_token_id] + stream[i * body:(i + 1) * body] for i in range(count)])


ROOT = Path(__file__).resolve().parents[1]


def _triton_version() -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def under_triton_interpreter(test_file: str, select: str, expected: int, timeout: int = 600) -> None:
    """Run the tests of `test_file` that `-k select` picks in a child pytest with TRITON_INTERPRET=1
    (Triton picks interpreted or compiled kernels when they are defined, so the variable must be
    set before anything imports them), and require that all `expected` of them pass."""
    version = _triton_version()
    if version is None:
        pytest.skip("triton is not installed")
    if version < (3, 7):
        # The interpreter before 3.7 cannot run a loop whose bounds are tensors, as the norm's backward
        # walks its rows ("only 0-dimensional arrays can be converted to Python scalars"); compiling is
        # unaffected: test_kernels_compile_for_an_h100 builds every kernel with 3.4 to 3.9.
        pytest.skip(f"Triton {'.'.join(map(str, version))}'s interpreter cannot run our kernels (3.7 or newer can)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, str(Path(test_file).resolve())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == expected, tail


def torchrun(*args, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N ARGS` on the CPU, one thread per rank, from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# `heal`'s method settings the tests give by name, as the command line's options do.
METHOD_SETTINGS = {"lora_rank", "lora_alpha", "lora_dropout", "targets", "adapt", "loss", "calib_tokens", "ridge"}


def heal_config(every_method: bool = False, **kw):
    """A HealConfig from keywords, the method settings among them put in `method_args`; the
    method keeps those of its own (a test's defaults give LoRA's rank and the maps' tokens alike),
    or, `every_method`, all of them, for a comparison of methods to hand out."""
    from depthcurse.heal import HealConfig

    args = {**kw.pop("method_args", {}), **{k: kw.pop(k) for k in list(kw) if k in METHOD_SETTINGS}}
    cfg = HealConfig(**kw, method_args=args)
    return cfg if every_method else cfg.for_method(cfg.method)


def lora_objective(model, layers, loss="lm", **settings):
    """LoRA's objective on `model` without `layers`, as a heal makes it (adapters added, B = 0)."""
    from depthcurse.heal import HealContext, build_method

    method = build_method("lora", {"lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "loss": loss, **settings})
    ctx = HealContext(model=model, layers=tuple(layers), calibration=None)
    method.prepare(ctx)
    return method.objective(ctx), method, ctx
