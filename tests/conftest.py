"""Shared fixtures: tiny tokenizers trained in the test session, saved tiny models, the CLI.

Nothing here touches the hub: the tests run offline, like CI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import CORPUS, QA_CORPUS, tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# `--dtype auto` computes a bf16 checkpoint in bf16 on a CPU that has native bf16 and in fp32 on one
# that has not (runtime.pick_dtype): told "none", every machine computes what the tests pin, in fp32.
# The tests of that choice set the variable themselves.
os.environ["DEPTHCURSE_CPU_BF16"] = "0"
if Path(__file__).resolve().parents[1].name == "mutants":
    # mutmut runs the tests in its copy of the checkout (mutants/), forking a child per mutant from a
    # process that ran them: GNU OpenMP hangs in a child forked after its threads ran (a log-softmax
    # of 4 x 30 did), so there torch, and the kernels, which take its count, keep to one thread
    torch.set_num_threads(1)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores (`make test` runs two on two): one thread each, and in the processes
    # they start, or the thread pools spin against each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """A test through the command line is marked `cli`: `make mutate` leaves out those of the instruments,
    whose figures and lines unit tests pin at a fraction of the time per mutant."""
    for item in items:
        if "run_cli" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cli)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine the thread pool's
    spinning makes such tests 8-40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """One offline-asset cache per test run: the real models and data are built once."""
    return tmp_path_factory.mktemp("depthcurse-cache")


@pytest.fixture
def shared(monkeypatch, session_cache):
    """Use the session-wide asset cache (SmolLM2 conversion, MMLU, wiki...)."""
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(session_cache))
    return session_cache


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture()
def tiny_model_dir(tmp_path, tiny_tokenizer):
    """A saved tiny Llama (4 layers) with its tokenizer: loads like any local checkpoint."""
    model = tiny_llama(len(tiny_tokenizer))
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("\n\n".join(CORPUS * 8), encoding="utf-8")
    return path


@pytest.fixture()
def run_cli(capsys, monkeypatch, tmp_path_factory):
    """Run the console entry point in-process; returns (exit code, stdout, stderr).

    It runs in an empty working directory, so default output folders (runs/...) never land in the repo."""
    from depthcurse.cli import main

    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))

    def run(*args: str):
        capsys.readouterr()  # drop what fixtures printed
        monkeypatch.setattr(sys, "argv", ["depthcurse", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


# --------------------------------------------------------------------------- tiny BERT (extractive QA)
@pytest.fixture(scope="session")
def tiny_bert_tokenizer():
    """A WordPiece tokenizer with BERT's [CLS] question [SEP] context [SEP] template (fast: offsets work)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False)
    tok.train_from_iterator(QA_CORPUS * 20, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
                                   model_max_length=128, model_input_names=["input_ids", "token_type_ids", "attention_mask"])


@pytest.fixture(scope="session")
def bos_tokenizer(tiny_tokenizer):
    """The tiny tokenizer, but putting <bos> before every text, as Llama's, Gemma's and Mistral's do."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str())
    backend.add_special_tokens(["<bos>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", backend.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture()
def docs_file(tmp_path):
    """40 distinct documents, so that held-out ones (heal's, lns-train's) are never trained on."""
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"marker{i}x {CORPUS[i % len(CORPUS)]} {CORPUS[(i + 2) % len(CORPUS)]}" for i in range(40)), encoding="utf-8")
    return path


def _saved_llama(path, tokenizer, layers: int, seed: int):
    """A tiny Llama saved with its tokenizer: loads like any local checkpoint."""
    tiny_llama(len(tokenizer), layers=layers, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def six_dir(tmp_path, tiny_tokenizer):
    """A saved tiny Llama of 6 layers: C(6, 2) = 15 and C(6, 3) = 20 removals (select's searches)."""
    return _saved_llama(tmp_path / "six", tiny_tokenizer, layers=6, seed=3)


@pytest.fixture()
def bos_model_dir(tmp_path, bos_tokenizer):
    """A tiny Llama with 5 layers and a tokenizer that puts BOS first, as Llama's does."""
    return _saved_llama(tmp_path / "tiny-bos", bos_tokenizer, layers=5, seed=1)
