"""Meta's original Llama layout (params.json, consolidated.NN.pth, tokenizer.model), converted once.

The reference is Meta's own forward, written here from `llama/model.py` (rotary embeddings on
interleaved pairs as complex numbers, weights in Meta's names): the converted transformers model
must give its logits, and those of the Llama the weights came from. The checkpoint is split over
two model-parallel shards the way Meta's are (rows or columns per weight), so the joining is tested too.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import CORPUS, assert_one_line_error, tiny_llama
from depthcurse.assets import meta_llama
from depthcurse.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = ("wq", "wk", "wv", "w1", "w3")  # split over output rows; wo, w2 over input columns


def _meta_state(hf) -> dict:
    """The Llama's weights in Meta's names and rotary layout (the inverse of transformers' permutation)."""
    c = hf.config
    hd = c.hidden_size // c.num_attention_heads

    def unpermute(w, heads):
        return w.view(heads, 2, hd // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            f"layers.{i}.attention.wq.weight": unpermute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads),
            f"layers.{i}.attention.wk.weight": unpermute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads),
            f"layers.{i}.attention.wv.weight": sd[p + "self_attn.v_proj.weight"],
            f"layers.{i}.attention.wo.weight": sd[p + "self_attn.o_proj.weight"],
            f"layers.{i}.feed_forward.w1.weight": sd[p + "mlp.gate_proj.weight"],
            f"layers.{i}.feed_forward.w2.weight": sd[p + "mlp.down_proj.weight"],
            f"layers.{i}.feed_forward.w3.weight": sd[p + "mlp.up_proj.weight"],
            f"layers.{i}.attention_norm.weight": sd[p + "input_layernorm.weight"],
            f"layers.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        })
    return out


def _shard(state: dict, n: int) -> list[dict]:
    shards = [{} for _ in range(n)]
    for key, w in state.items():
        name = key.split(".")[-2]
        dim = 0 if name in (*ROWS, "output") else 1 if name in ("wo", "w2", "tok_embeddings") else None
        for i in range(n):
            shards[i][key] = w.clone() if dim is None else w.chunk(n, dim=dim)[i].clone()
    return shards


def meta_forward(w: dict, params: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Meta's Transformer.forward (llama/model.py) for a whole sequence, in fp32."""
    dim, H = params["dim"], params["n_heads"]
    KV, hd, eps = params.get("n_kv_heads") or H, dim // H, params["norm_eps"]
    B, T = tokens.shape
    freqs = 1.0 / (params.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    cis = torch.polar(torch.ones(T, hd // 2), torch.outer(torch.arange(T).float(), freqs))

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rotary(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3)

    mask = torch.full((T, T), float("-inf")).triu(1)
    h = w["tok_embeddings.weight"][tokens]
    for i in range(params["n_layers"]):
        L = lambda n: w[f"layers.{i}.{n}.weight"]  # noqa: E731
        x = rms(h, L("attention_norm"))
        q = rotary((x @ L("attention.wq").T).view(B, T, H, hd))
        k = rotary((x @ L("attention.wk").T).view(B, T, KV, hd)).repeat_interleave(H // KV, dim=2)
        v = (x @ L("attention.wv").T).view(B, T, KV, hd).repeat_interleave(H // KV, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = F.softmax(q @ k.transpose(2, 3) / math.sqrt(hd) + mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(B, T, dim) @ L("attention.wo").T
        x = rms(h, L("ffn_norm"))
        h = h + (F.silu(x @ L("feed_forward.w1").T) * (x @ L("feed_forward.w3").T)) @ L("feed_forward.w2").T
    return rms(h, w["norm.weight"]) @ w["output.weight"].T


def _sentencepiece_model() -> bytes:
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 20), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, character_coverage=1.0, minloglevel=2)
    return buf.getvalue()


@pytest.fixture(scope="module")
def meta_folder(tmp_path_factory):
    """A tiny Llama-2-style download: two shards, GQA, a SentencePiece tokenizer; and the Llama it came from."""
    folder = tmp_path_factory.mktemp("llama-2-tiny")
    spm_model = _sentencepiece_model()
    hf = tiny_llama(400, layers=3)
    with torch.no_grad():  # larger weights: every layer and the rotary layout visibly matter
        for p in hf.parameters():
            p.mul_(10)
    c = hf.config
    params = {"dim": c.hidden_size, "n_layers": c.num_hidden_layers, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
              "vocab_size": -1, "multiple_of": 16, "norm_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"]}
    (folder / "params.json").write_text(json.dumps(params))
    for i, shard in enumerate(_shard(_meta_state(hf), 2)):
        torch.save(shard, folder / f"consolidated.{i:02d}.pth")
    (folder / "tokenizer.model").write_bytes(spm_model)
    return folder, hf, params


def test_the_converted_model_equals_meta_and_the_llama_it_came_from(meta_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    folder, hf, params = meta_folder
    loaded = load_model(str(folder), dtype="fp32", device="cpu")
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.source.startswith(str(tmp_path / "cache"))
    ids = torch.randint(3, 400, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, original = loaded.model(ids).logits, hf(ids).logits
    meta = meta_forward(_meta_state(hf), params, ids)
    c = hf.config  # not vacuous: the same weights without the rotary permutation give other logits
    unpermuted = {**_meta_state(hf), **{f"layers.{i}.attention.w{x}.weight": hf.state_dict()[f"model.layers.{i}.self_attn.{x}_proj.weight"]
                                        for i in range(c.num_hidden_layers) for x in "qk"}}
    assert not torch.allclose(meta_forward(unpermuted, params, ids), meta, atol=1e-2)
    torch.testing.assert_close(ours, meta, rtol=1e-4, atol=1e-3)  # Meta's forward: the rotary layout is right
    torch.testing.assert_close(ours, original, rtol=0, atol=0)  # the same weights as the Llama, exactly

    # the tokenizer is the SentencePiece model's own, with Llama's BOS first
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=(folder / "tokenizer.model").read_bytes())
    text = "Paris is the capital of France. Zebra 123 \u00e9"
    assert loaded.tokenizer(text).input_ids == [1, *sp.encode(text)]

    # converted once: a second load takes the cache entry as it is
    entry = loaded.source
    mtime = (tmp_path / "cache").stat().st_mtime_ns
    again = load_model(str(folder), dtype="fp32", device="cpu")
    assert again.source == entry and (tmp_path / "cache").stat().st_mtime_ns == mtime


def test_a_meta_folder_with_broken_weights_is_one_line(meta_folder, tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    folder, _, _ = meta_folder
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("params.json", "tokenizer.model"):
        (broken / name).write_bytes((folder / name).read_bytes())
    (broken / "consolidated.00.pth").write_bytes((folder / "consolidated.00.pth").read_bytes()[:5000])
    code, out, err = run_cli("prune", str(broken), "--task", "ppl", "--data", "wiki", "--limit", "1", "--out", str(tmp_path / "out"))
    assert_one_line_error(code, out, err, "consolidated.00.pth is not a readable PyTorch checkpoint")
    (broken / "consolidated.00.pth").unlink()
    code, out, err = run_cli("prune", str(broken), "--task", "ppl", "--data", "wiki", "--limit", "1", "--out", str(tmp_path / "out"))
    assert_one_line_error(code, out, err, "no consolidated.*.pth weights")
    (broken / "params.json").write_text("{not json")
    code, out, err = run_cli("prune", str(broken), "--task", "ppl", "--data", "wiki", "--limit", "1", "--out", str(tmp_path / "out"))
    assert_one_line_error(code, out, err, "not a readable params.json")


def test_a_llama3_tokenizer_model_is_tiktoken_with_its_special_tokens(tmp_path):
    """Llama 3's tokenizer.model is tiktoken's format: the converted tokenizer encodes as tiktoken
    itself does with Meta's pattern and special tokens, after <|begin_of_text|>."""
    import base64

    import transformers

    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"he", b"the", b" t", b" the", b"ca", b"cap", b"it", b"ital", b"al"):
        ranks.setdefault(merge, len(ranks))
    (tmp_path / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    assert meta_llama._tokenizer_kind(tmp_path / "tokenizer.model") == "tiktoken"
    meta_llama._write_tokenizer(tmp_path / "tokenizer.model", tmp_path / "out", "3.1", 8192)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    special = meta_llama._LLAMA3_SPECIAL["3.1"]
    assert len(special) == 256
    enc = tiktoken.Encoding("llama3-tiny", pat_str=meta_llama._LLAMA3_PATTERN, mergeable_ranks=ranks,
                            special_tokens={s: len(ranks) + i for i, s in enumerate(special)})
    text = "the capital of Italy is Rome, they say.\n  The 1234 caps"
    assert tok(text).input_ids == [len(ranks), *enc.encode(text)]
    assert tok.convert_tokens_to_ids("<|eot_id|>") == enc.encode("<|eot_id|>", allowed_special="all")[0]


def test_a_hub_repository_in_meta_layout_is_downloaded_converted_and_then_loads_offline(meta_folder, tmp_path, monkeypatch):
    """`depthcurse prune meta-llama/Llama-2-7b`: the repository has no config.json, so its Meta
    files are downloaded (here: served from a local folder) and converted; later, offline, the
    conversion in the cache is what the name resolves to."""
    import huggingface_hub

    from depthcurse import assets

    folder, hf, _ = meta_folder
    monkeypatch.setenv("DEPTHCURSE_CACHE", str(tmp_path / "cache"))
    asked = []
    monkeypatch.setattr(assets, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "file_exists", lambda repo, name, revision=None: asked.append((repo, name)) or name == "params.json")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, revision=None, allow_patterns=None: str(folder))

    def no_config(*args, **kwargs):  # the hub's answer for a repository without config.json
        raise OSError("meta-llama/Llama-2-7b does not appear to have a file named config.json")

    real_config = __import__("transformers").AutoConfig.from_pretrained
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda src, **kw: no_config() if src == "meta-llama/Llama-2-7b" else real_config(src, **kw))
    loaded = load_model("meta-llama/Llama-2-7b", dtype="fp32", device="cpu")
    assert ("meta-llama/Llama-2-7b", "params.json") in asked
    assert loaded.source == str(meta_llama.converted_path("meta-llama/Llama-2-7b"))
    ids = torch.randint(3, 400, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, hf(ids).logits, rtol=0, atol=0)

    monkeypatch.setattr(assets, "hub_reachable", lambda: False)  # offline now: the cache answers
    assert load_model("meta-llama/Llama-2-7b", dtype="fp32", device="cpu").source == loaded.source
