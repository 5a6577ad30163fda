"""Every decoder family researchers prune, through layer surgery and the reuse engine (tiny random configs).

Two references, neither using depthcurse: a model built from a config with the layer left out
(the per-layer config lists edited by hand in `helpers.built_without`), and the model's own
forward. The removals are the first, a middle and the last layer, a layer whose kind differs
from its neighbours' (attention type, dense among MoE, NoPE) and two layers at once.
"""

from __future__ import annotations

import copy

import pytest
import torch

from families import FAMILIES, N, VOCAB, family_model, removals
from helpers import built_without
from depthcurse.prune.layout import TokenRequest
from depthcurse.prune.scoring import score_requests
from depthcurse.prune.stepping import Stepper
from depthcurse.surgery import find_blocks, removed_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_pruned_model_equals_one_built_without_the_layer(name):
    model = family_model(name, attn="eager")
    ids = _ids()
    before, config_before = _logits(model, ids), model.config.to_dict()
    for removed in removals(name):
        with removed_layers(model, removed):
            got = _logits(model, ids)
            # The pruned config describes the kept blocks: a model built from it takes their weights as they are.
            rebuilt = type(model)(copy.deepcopy(model.config)).eval()
            rebuilt.load_state_dict(model.state_dict(), strict=True)
            torch.testing.assert_close(_logits(rebuilt, ids), got, rtol=0, atol=0)
        torch.testing.assert_close(got, _logits(built_without(model, find_blocks(model).path, removed), ids), rtol=0, atol=0)
        assert not torch.allclose(got, before, atol=1e-3), removed  # the layer did something
    torch.testing.assert_close(_logits(model, ids), before, rtol=0, atol=0)
    assert model.config.to_dict() == config_before


def _requests() -> list[TokenRequest]:
    """Rows of 6 to 41 tokens, half after a shared 20-token prefix (longer than the 8-token windows and chunks)."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    requests = []
    for i, n in enumerate((41, 6, 17, 9, 30, 12)):
        tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        if i % 2:
            tokens = shared + tokens
        scored = 2 + i % 3
        requests.append(TokenRequest(tuple(tokens), len(tokens) - scored, tuple(torch.randint(0, VOCAB, (scored,), generator=gen).tolist())))
    return requests


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_reuse_engine_scores_every_family_as_its_own_forward(name):
    model = family_model(name)  # the attention users get: sdpa where the family has it
    stepper = Stepper(model)
    stepper.check()  # the engine runs it, no fallback
    requests, variants = _requests(), [(), *removals(name)]
    lp, greedy, stats = score_requests(stepper, requests, variants, max_memory=2**30, min_prefix_saving=0)  # share whatever saves
    assert stats["prefix_groups"] == 1
    assert (stats["packing"] == "packed") == (name != "llama4"), stats["packing"]  # Llama-4: see Stepper.packing_fails
    for vi, removed in enumerate(variants):
        with removed_layers(model, removed):
            for ri, r in enumerate(requests):
                logp = _logits(model, torch.tensor([r.inputs]))[0].float().log_softmax(-1)
                pos, tgt = torch.arange(r.start, r.start + len(r.targets)), torch.tensor(r.targets)
                assert lp[vi, ri].item() == pytest.approx(logp[pos, tgt].sum().item(), abs=1e-4), (removed, ri)
                assert bool(greedy[vi, ri]) == bool((logp[pos].argmax(-1) == tgt).all())


def test_every_family_has_the_layers_it_claims():
    for name in FAMILIES:
        assert len(find_blocks(family_model(name)).layers) == N
