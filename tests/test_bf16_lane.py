"""The precision users get (issue 87): `--dtype auto` computes a bf16 checkpoint in bf16 on every CPU
with native bf16, so every instrument's core runs here in bf16 against its own fp32 figure on the same
tiny model, within a stated tolerance; `--as csordas` in bf16 equals the port of their code run in bf16
(they take norms and cosines in the model's dtype); and the choice of bf16 is tested on both kinds of
CPU by faking the processor's answer.

The tolerance, from bf16's 8 bits of mantissa (2^-8 = 0.4% per rounding) over 5 layers: every size,
KL, loss, influence and distance within 3% of fp32's (relative, with 0.02 absolute beside it for
a figure near 0: a cosine, an R^2, a KL of 0.01), a share of tokens whose top-1 agrees within 2 tokens
of a window's (a near-tie turns). Measured on these models: 1.1% at most on sizes, 1.6% on KLs and losses,
0.6% on influence, 0.005 on cosines and R^2, 2 tokens on agreement.
"""

from __future__ import annotations

import pytest
import torch

from csordas_port import assert_as_their_code
from families import N, VOCAB, family_model

from depthcurse.depth.definitions import DEFINITIONS
from depthcurse.depth.measure import measure_depth_use

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.instruments]

# Llama; Gemma 2 (post-norms, a soft-cap); Granite (multipliers on the embedding, every branch and the logits)
LANE = ("llama", "gemma2", "granite")
WINDOWS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(11))
REL, ABS, TOKENS = 0.03, 0.02, 2 / 15 + 1e-6  # 2 tokens of a window's 15 predictions


def _pair(name):
    return family_model(name), family_model(name).to(torch.bfloat16)


def _close(got, want, rel=REL, absolute=ABS):
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    known = ~torch.isnan(want)
    assert torch.equal(known, ~torch.isnan(got))
    assert ((got - want).abs() <= torch.maximum(rel * want.abs(), torch.tensor(absolute)))[known].all(), (got, want)


@pytest.mark.parametrize("name", LANE)
def test_depth_use_in_bf16_is_its_fp32_figure_within_the_tolerance(name):
    fp32, bf16 = (measure_depth_use(m, WINDOWS, 2) for m in _pair(name))
    for figure in ("attn_norm", "mlp_norm", "lens_kl", "influence", "output_change"):
        _close(getattr(bf16, figure), getattr(fp32, figure))
    for figure in ("attn_cos", "mlp_cos"):
        _close(getattr(bf16, figure), getattr(fp32, figure), rel=0.0)
    _close(bf16.lens_top1, fp32.lens_top1, rel=0.0, absolute=TOKENS)


@pytest.mark.parametrize("name", ("llama", "gemma2", "olmo2", "granite"))
def test_depth_use_as_csordas_in_bf16_equals_their_code_run_in_bf16(name):
    """Their norms, floors, h + a and cosines (summed over a window's tokens) in the model's dtype, then
    cast: the port run on the bf16 model gives the same figures to float32's rounding, where casting
    first would move them by 1e-3 (the tolerance of the other tests)."""
    model = family_model(name).to(torch.bfloat16)
    use = measure_depth_use(model, WINDOWS, 2, definitions=DEFINITIONS["csordas"])
    assert_as_their_code(use, model, WINDOWS, name, rel=1e-5, absolute=1e-6)


@pytest.mark.parametrize("name", LANE)
def test_selects_scores_and_the_engines_in_bf16_are_their_fp32_figures_within_the_tolerance(name):
    from depthcurse.prune.scoring import score_requests
    from depthcurse.prune.stepping import Stepper
    from depthcurse.prune.layout import TokenRequest
    from depthcurse.select.scoring import CalibrationScorer

    fp32, bf16 = _pair(name)
    singles = [(i,) for i in range(N)]
    got, want = (CalibrationScorer(m, WINDOWS, 2, {}, lambda: None).per_window(singles) for m in (bf16, fp32))
    for g, w in zip(got, want):
        _close(g[0], w[0])  # loss
        _close(g[1], w[1])  # KL
        _close(g[2], w[2], rel=0.0, absolute=TOKENS)  # top-1 agreement
    requests = [TokenRequest(tuple(row[:12].tolist()), 8, tuple(row[12:].tolist())) for row in WINDOWS]
    (lp16, _, _), (lp32, _, _) = (score_requests(Stepper(m), requests, [(), *singles], max_memory=2**30) for m in (bf16, fp32))
    _close(lp16.tolist(), lp32.tolist())


@pytest.mark.parametrize("name", LANE)
def test_angular_distance_and_the_depth_map_in_bf16_are_their_fp32_figures_within_the_tolerance(name):
    from depthcurse.angular.measurement import measure
    from depthcurse.depth.depth_map import depth_map

    fp32, bf16 = _pair(name)
    mask = torch.ones_like(WINDOWS)
    got, want = (measure(m, [(WINDOWS, mask)], position="all", identity_tokens=0) for m in (bf16, fp32))
    _close(got.pairwise, want.pairwise, absolute=2e-3)
    fit = torch.randint(0, VOCAB, (6, 16), generator=torch.Generator().manual_seed(2))
    got, want = (depth_map(m, m, fit, WINDOWS, batch_size=3) for m in (bf16, fp32))
    _close(got["scores"]["r2_dims"]["mean"], want["scores"]["r2_dims"]["mean"], rel=0.0)
    assert got["best"] == want["best"] == list(range(N))


# --------------------------------------------------------------------------- auto's choice on both kinds of CPU
@pytest.mark.parametrize("avx512_bf16, amx", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("told", [None, "0", "1", "yes"])
def test_the_cpu_flag_and_the_environment_decide_on_either_kind_of_processor(monkeypatch, avx512_bf16, amx, told):
    """The processor's answer faked both ways: unset (or not 0 or 1), it decides; `DEPTHCURSE_CPU_BF16`
    0 or 1 overrides it either way, so the override is seen to work where it changes the answer."""
    from depthcurse.runtime import cpu_computes_bf16, pick_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    if told is None:
        monkeypatch.delenv("DEPTHCURSE_CPU_BF16", raising=False)
    else:
        monkeypatch.setenv("DEPTHCURSE_CPU_BF16", told)
    native = {"0": False, "1": True}.get(told, avx512_bf16 or amx)
    assert cpu_computes_bf16() is native
    assert pick_dtype("auto", "cpu").dtype == (torch.bfloat16 if native else torch.float32)
