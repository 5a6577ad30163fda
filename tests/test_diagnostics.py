"""Angular distances and per-layer statistics against a naive per-sequence reference."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from helpers import CORPUS, tiny_llama
from depthcurse.angular import measurement as diagnostics
from helpers import assert_one_line_error

DOCS = [CORPUS[0], CORPUS[2][:40], CORPUS[3], CORPUS[1][:25], CORPUS[4], CORPUS[5][:60], CORPUS[2]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _randomised(model: nn.Module) -> nn.Module:
    """Random norm gains, so that the final norm changes directions as well as lengths."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
    return model


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return _randomised(tiny_llama(len(tiny_tokenizer), layers=5, seed=3))


@pytest.fixture(scope="module")
def sequences(tiny_tokenizer):
    data = diagnostics.tokenise_docs(tiny_tokenizer, DOCS, seq_len=24, budget=10_000)
    lengths = [len(s) for s in data.sequences]
    assert len(set(lengths)) > 2 and max(lengths) == 24  # padding really happens in a batch
    return data.sequences


def _reference_streams(model, ids: list[int]) -> list[torch.Tensor]:
    """x_0..x_L for one unpadded sequence: hidden_states[l] for l < L, and the last block's
    output from a copy whose final norm is the identity."""
    x = torch.tensor([ids])
    with torch.no_grad():
        hs = model(input_ids=x, output_hidden_states=True).hidden_states
        ref = copy.deepcopy(model)
        ref.model.norm = nn.Identity()
        hs_ref = ref(input_ids=x, output_hidden_states=True).hidden_states
    L = model.config.num_hidden_layers
    return [hs[l][0].double() for l in range(L)] + [hs_ref[L][0].double()]


def _naive(model, sequences, position: str):
    L = model.config.num_hidden_layers
    d = [[0.0] * (L + 1) for _ in range(L + 1)]
    count = 0
    bi, upd, norm, var, tokens = [0.0] * L, [0.0] * L, [0.0] * (L + 1), [0.0] * (L + 1), 0
    bulk, peak, channel = [0.0] * (L + 1), [0.0] * (L + 1), [-1] * (L + 1)
    for ids in sequences:
        xs = _reference_streams(model, ids)
        positions = [len(ids) - 1] if position == "last" else range(len(ids))
        for t in positions:
            count += 1
            for i in range(L + 1):
                for j in range(L + 1):
                    cos = torch.dot(xs[i][t], xs[j][t]) / (xs[i][t].norm() * xs[j][t].norm())
                    d[i][j] += math.acos(max(-1.0, min(1.0, cos.item()))) / math.pi
        for t in range(len(ids)):
            tokens += 1
            for l in range(L + 1):
                norm[l] += xs[l][t].norm().item()
                var[l] += xs[l][t].var(unbiased=False).item()
                order = xs[l][t].abs().argsort(descending=True)
                bulk[l] += xs[l][t][order[4:]].var(unbiased=False).item()  # without the token's 4 largest channels
                if xs[l][t].abs().max().item() > peak[l]:
                    peak[l], channel[l] = xs[l][t].abs().max().item(), int(order[0])
            for l in range(L):
                a, b = xs[l][t], xs[l + 1][t]
                bi[l] += (torch.dot(a, b) / (a.norm() * b.norm())).item()
                upd[l] += ((b - a).norm() / a.norm()).item()
    return {
        "pairwise": [[v / count for v in row] for row in d],
        "count": count,
        "block_influence": [1 - v / tokens for v in bi],
        "relative_update": [v / tokens for v in upd],
        "norm": [v / tokens for v in norm],
        "variance": [v / tokens for v in var],
        "variance_bulk": [v / tokens for v in bulk],
        "max_activation": peak,
        "max_channel": channel,
    }


def _close(a, b, tol=1e-5):
    return torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), atol=tol, rtol=tol)


@pytest.mark.parametrize("position", ["last", "all"])
def test_matches_a_naive_per_sequence_reference(llama, sequences, tiny_tokenizer, position):
    batches = diagnostics.make_batches(sequences, 3, tiny_tokenizer.pad_token_id)
    result = diagnostics.measure(llama, batches, position=position)
    ref = _naive(llama, sequences, position)
    assert result.samples == ref["count"] == (len(sequences) if position == "last" else sum(map(len, sequences)))
    assert _close(result.pairwise, ref["pairwise"])
    for key in ("block_influence", "relative_update", "norm", "variance", "variance_bulk", "max_activation"):
        assert _close(getattr(result, key), ref[key]), key
    assert result.max_channel == ref["max_channel"]
    assert result.distance(1, 3) == result.pairwise[1][4]
    best = result.best_blocks()
    assert [b["n"] for b in best] == [1, 2, 3, 4, 5] and best[-1]["l"] == 0
    assert best[0]["distance"] == min(result.distance(l, 1) for l in range(5))


def test_padding_and_batch_size_do_not_change_the_result(llama, sequences, tiny_tokenizer):
    for position in ("last", "all"):
        one = diagnostics.measure(llama, diagnostics.make_batches(sequences, 1, tiny_tokenizer.pad_token_id), position=position)
        three = diagnostics.measure(llama, diagnostics.make_batches(sequences, 3, 0), position=position)  # another pad id too
        assert one.samples == three.samples
        assert _close(one.pairwise, three.pairwise)
        assert _close(one.block_influence, three.block_influence) and _close(one.norm, three.norm)


def test_last_stream_is_before_the_final_norm(llama, sequences):
    ids = sequences[0]
    result = diagnostics.measure(llama, diagnostics.make_batches([ids], 1, 0), position="all")
    x = torch.tensor([ids])
    with torch.no_grad():
        post = llama(input_ids=x, output_hidden_states=True).hidden_states[-1][0]
    pre = _reference_streams(llama, ids)[-1]
    assert _close(result.norm[-1], pre.norm(dim=-1).mean().item())
    assert abs(result.norm[-1] - post.norm(dim=-1).mean().item()) > 1e-2
    # the direction differs too (random norm gains): d(x_{L-1}, x_L) follows the pre-norm stream
    prev = _reference_streams(llama, ids)[-2]
    cos_post = torch.nn.functional.cosine_similarity(prev, post.double(), dim=-1)
    d_post = (torch.arccos(cos_post.clamp(-1, 1)) / math.pi).mean().item()
    assert abs(result.pairwise[-2][-1] - d_post) > 1e-3


def test_encoder_blocks_are_measured_too(sequences):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=400, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32)).eval()
    batched = diagnostics.measure(bert, diagnostics.make_batches(sequences, 4, 0), position="last")
    single = diagnostics.measure(bert, diagnostics.make_batches(sequences, 1, 0), position="last")
    assert _close(batched.pairwise, single.pairwise)
    ids = sequences[0]
    with torch.no_grad():
        hs = bert(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states  # no final norm in BERT
    one = diagnostics.measure(bert, diagnostics.make_batches([ids], 1, 0), position="last")
    a, b = hs[0][0, -1].double(), hs[3][0, -1].double()
    want = math.acos(max(-1.0, min(1.0, (a @ b / (a.norm() * b.norm())).item()))) / math.pi
    assert abs(one.distance(0, 3) - want) < 1e-5


def test_token_budget_is_exact_and_shortfall_is_reported(tiny_tokenizer):
    data = diagnostics.tokenise_docs(tiny_tokenizer, DOCS, seq_len=16, budget=37)
    assert data.tokens == 37 == sum(map(len, data.sequences)) and not data.exhausted
    data = diagnostics.tokenise_docs(tiny_tokenizer, DOCS + ["  "], seq_len=16, budget=10**6)
    assert data.exhausted and data.tokens == sum(map(len, data.sequences)) and len(data.sequences) == len(DOCS)


def test_cli_writes_all_files(run_cli, tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "ang"
    code, stdout, err = run_cli("angular-distance", tiny_model_dir, "--data", text_file, "--tokens", "300", "--seq-len", "16", "--batch-size", "3", "--out", out)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} >= {"angular.csv", "angular.json", "angular.png", "layers.csv", "layers.png"}
    data = json.loads((out / "angular.json").read_text())
    assert data["run"]["tokens_seen"] == 300 and data["run"]["model_class"] == "LlamaModel"
    assert data["run"]["wall_time_s"] > 0 and "angular-distance" in data["run"]["environment"]["command"]  # how it was made (issue 90)
    assert data["run"]["dtype"] and data["run"]["dtype_why"]
    assert len(data["matrix"]) == 4 and len(data["matrix"][0]) == 4 and data["matrix"][3][1] is None
    assert [b["n"] for b in data["best_blocks"]] == [1, 2, 3, 4]
    lines = (out / "angular.csv").read_text().splitlines()
    assert lines[0] == "l,n,distance,count" and len(lines) == 1 + 4 + 3 + 2 + 1
    assert (out / "layers.csv").read_text().splitlines()[0] == (
        "l,block_influence,relative_update,norm,variance,variance_bulk,max_activation,max_channel,max_position,max_token,median_activation,max_over_median,writes_massive,"
        "identity_distance,attn_gain,mlp_gain,count")
    assert len(data["identity"]["identity_distance"]) == 4 and data["identity"]["tokens"] == 300  # fewer than --identity-tokens 1024
    assert "l*" in stdout and "warning" not in err

    code, _, err = run_cli("angular-distance", tiny_model_dir, "--data", text_file, "--tokens", "100000", "--seq-len", "8", "--max-n", "2", "--token-position", "all", "--no-normalize", "--out", out)
    assert code == 0, err
    assert "warning:" in err and "holds only" in err
    assert len(json.loads((out / "angular.json").read_text())["matrix"]) == 2


@pytest.mark.parametrize(
    "args, match",
    [
        (["--tokens", "0"], "--tokens must be positive"),
        (["--tokens", "-5"], "--tokens must be positive"),
        (["--max-n", "5"], "--max-n 5 is out of range"),
        (["--max-n", "0"], "--max-n 0 is out of range"),
        (["--token-position", "first"], "unknown --token-position"),
        (["--data", "{tmp}/empty.txt"], "holds no text"),
        (["--probes", "0"], "--probes at least 1"),
        (["--identity-tokens", "-1"], "--identity-tokens must be 0 or more"),
        # one document of 10 tokens: one vector with the last-token position, a heatmap of one sample
        (["--tokens", "10"], "--tokens 10 gives 1 token vector of"),
        (["--tokens", "5", "--token-position", "all"], "--tokens 5 gives 5 token vectors of"),
    ],
)
def test_bad_input_gets_one_clear_line(run_cli, tiny_model_dir, text_file, tmp_path, args, match):
    (tmp_path / "empty.txt").write_text("\n\n")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--data" not in args:
        args += ["--data", str(text_file)]
    assert_one_line_error(*run_cli("angular-distance", tiny_model_dir, "--seq-len", "16", *args, "--out", tmp_path / "o"), match)
