"""Shared fixtures: a tiny tokenizer trained in the test session and tiny random decoders.

Nothing here touches the hub: the tests run offline, like CI.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

CORPUS = [
    "The residual stream of a transformer grows with depth, and deep blocks change it little.",
    "Question: which layer can be removed?\nA. the first\nB. a middle one\nC. the last\nD. none\nAnswer: B",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "The following are multiple choice questions (with answers) about abstract algebra and anatomy.",
    "Find the degree for the given field extension Q(sqrt(2), sqrt(3)) over Q. 0 1 2 3 4 5 6 7 8 9",
]


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def needs(*packages: str):
    """Skip cleanly when a real offline asset package is not installed."""
    missing = [p for p in packages if not has_package(p)]
    return pytest.mark.skipif(bool(missing), reason=f"offline asset package(s) not installed: {', '.join(missing)}")


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


def tiny_llama(vocab_size: int, layers: int = 4, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, pad_token_id=2, bos_token_id=None)
    return LlamaForCausalLM(config).eval()


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

QA_CORPUS = [
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "What is the capital of France? Which city is the capital of Germany? Who wrote the book?",
    "The river flows through the valley and the old town. The bridge was built in 1850 by engineers.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
]


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


def tiny_bert(vocab_size: int, layers: int = 4, seed: int = 0, qa: bool = True):
    """A random Post-LN BERT, with a span head (BertForQuestionAnswering) or without (BertModel)."""
    from transformers import BertConfig, BertForQuestionAnswering, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64, max_position_embeddings=128, pad_token_id=0)
    return (BertForQuestionAnswering if qa else BertModel)(config).eval()
