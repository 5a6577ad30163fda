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
