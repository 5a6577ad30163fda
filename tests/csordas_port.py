"""Csordás et al.'s depth-use functions, ported line by line, on any decoder family.

robertcsordas/llm_effective_depth, read in ShayanTalaei/llm_effective_depth @ e757a77:
`analysis/analyze_future_effects.py`'s `test_effect` as `analyze_current_effects.py` calls it,
`analysis/logitlens.py`'s `run_logitlens` and `analysis/analyze_norms.py`'s relative contributions and
cosines. Their scripts run under nnsight on Llama and Qwen (`llm.model.layers`, `layer.self_attn`,
`layer.mlp`, `llm.model.norm`, `llm.lm_head`); nnsight's `.output` and `.inputs` are forward hooks
here. On another family the port reads the modules its code reads by their names there (`PARTS`),
as their code would if its names were changed: the attention's and the MLP's own module outputs
(before any post-norm or multiplier), the final norm and the head applied raw (no soft-cap or logit
scale), the output's logits as the model gives them, every norm and cosine in the model's dtype.

Nothing here imports depthcurse: it is the reference `--as csordas` is held to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# What their code calls `llm.model`, `layers`, `self_attn`, `mlp`, `norm` and `lm_head`, per family (read off each
# family's modeling code); every family not named: Llama's names.
LLAMA = ("model", "layers", "self_attn", "mlp", "norm", "lm_head")
PARTS = {
    "llama4": ("model", "layers", "self_attn", "feed_forward", "norm", "lm_head"),
    "granitemoe": ("model", "layers", "self_attn", "block_sparse_moe", "norm", "lm_head"),
    "gpt_neox": ("gpt_neox", "layers", "attention", "mlp", "final_layer_norm", "lm_head"),
    "falcon": ("transformer", "h", "self_attention", "mlp", "ln_f", "lm_head"),
    "falcon_new": ("transformer", "h", "self_attention", "mlp", "ln_f", "lm_head"),
    "phi": ("model", "layers", "self_attn", "mlp", "final_layernorm", "lm_head"),
}


class Names:
    """`llm.model.layers`, `layer.self_attn`, ... of one model, by its family's names."""

    def __init__(self, model, family: str = "llama"):
        base, layers, self.attn, self.mlp, norm, head = PARTS.get(family, LLAMA)
        self.base = getattr(model, base)
        self.layers = getattr(self.base, layers)
        self.norm, self.lm_head = getattr(self.base, norm), getattr(model, head)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def traced(model, ids, names: Names, intervene=None, no_skip_front=1, modules=False):
    """nnsight's `llm.trace(prompt)` as their scripts use it, by forward hooks: each layer's input
    (`layer.inputs[0][0]`) and output (`layer.output[0]`), the skipped layer's output replaced first
    (`intervene_layer(..., part="layer")`: `layer.output = merge_io(layer.inputs[0][0], layer.output[0], t=None, no_skip_front)`),
    with `modules` also `layer.self_attn.output[0]` and `layer.mlp.output` (copied: Falcon adds to its
    MLP's output in place; an expert layer's rows in the stream's shape), and the output's logits."""
    def merge_io(intervened, orig, t=None, no_skip_front=1):  # analyze_future_effects.py, verbatim
        outs = [orig[:, :no_skip_front]]
        if t is not None:
            outs.append(intervened[:, no_skip_front:t].to(orig.device))
            outs.append(orig[:, t:])
        else:
            outs.append(intervened[:, no_skip_front:].to(orig.device))
        return torch.cat(outs, dim=1)

    seen, hooks = {}, []
    for i, layer in enumerate(names.layers):
        def hook(module, args, kwargs, output, i=i):
            inputs = args[0] if args else kwargs["hidden_states"]
            out = _first(output)
            if i == intervene:
                out = merge_io(inputs, out, None, no_skip_front)
            seen[i] = (inputs, out)
            return (out, *output[1:]) if isinstance(output, tuple) else out
        hooks.append(layer.register_forward_hook(hook, with_kwargs=True))
        if modules:
            hooks.append(getattr(layer, names.attn).register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("att", i), _first(o).clone())))
            hooks.append(getattr(layer, names.mlp).register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("mlp", i), _first(o).clone())))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    if modules:
        for i in range(len(names.layers)):
            seen["mlp", i] = seen["mlp", i].reshape(seen[i][0].shape)
    return seen, logits


def port_of_test_effect(model, prompt, names: Names):
    """`test_effect(llm, prompt, positions=[None], part="layer", no_skip_front=1)` of
    analysis/analyze_future_effects.py, as analysis/analyze_current_effects.py calls it
    (ShayanTalaei/llm_effective_depth @ e757a77; Csordás's own commit fae6e42 differs only in the
    order of a subtraction): per prompt, every layer skipped from the second token on."""
    n = len(names.layers)
    seen, logits = traced(model, prompt, names)
    residual_log = torch.cat([seen[i][1].detach().cpu().float() - seen[i][0].detach().cpu().float() for i in range(n)], dim=0)
    outputs = logits.detach().float().softmax(dim=-1).cpu()
    all_diffs, all_out_diffs = [], []
    for t in [None]:
        diffs, out_diffs = [], []
        for lskip in range(n):
            new, new_logits = traced(model, prompt, names, intervene=lskip)
            new_logs = torch.cat([(new[i][1].detach().cpu().float() - new[i][0].detach().cpu().float()) for i in range(n)], dim=0).float()
            future_orig, future_new = residual_log, new_logs  # get_future(data, None) is data
            relative_diffs = (future_orig - future_new).norm(dim=-1) / future_orig.norm(dim=-1).clamp(min=1e-6)
            diffs.append(relative_diffs.max(dim=-1).values)
            future_new_out = new_logits.detach().float().softmax(dim=-1).cpu()
            out_diffs.append((outputs - future_new_out).norm(dim=-1).max(dim=-1).values)
        all_diffs.append(torch.stack(diffs, dim=0))
        all_out_diffs.append(torch.stack(out_diffs, dim=0))
    return torch.stack(all_diffs, dim=0).max(dim=0).values, torch.stack(all_out_diffs, dim=0).max(dim=0).values


def port_of_current_effects(model, prompts, family: str = "llama"):
    """analyze_current_effects.py's `main` over its prompts: `d_max` and `dout_max`, each the largest over prompts."""
    names = Names(model, family)
    d_max, dout_max = None, torch.zeros([1])
    for prompt in prompts:
        diff_now, diff_out = port_of_test_effect(model, prompt[None], names)
        d_max = torch.max(d_max, diff_now) if d_max is not None else diff_now
        dout_max = torch.max(dout_max, diff_out)
    return d_max, dout_max


def port_of_run_logitlens(model, prompts, family: str = "llama", K=5):
    """analysis/logitlens.py's `run_logitlens` and its loop: per prompt the lens on the stream entering
    every layer (`lm_head(norm(tap))`, raw), KL(lens || output) and the top-K overlap, summed over
    prompts and divided by their number."""
    names = Names(model, family)
    n, vocab = len(names.layers), model.get_input_embeddings().weight.shape[0]
    accu_kl_div, accu_topk_overlaps = 0, 0
    for prompt in prompts:
        seen, out_logits = traced(model, prompt[None], names)
        with torch.no_grad():
            layer_logs = [names.lm_head(names.norm(seen[l][0])).detach().float() for l in range(n)]
        lout = out_logits.float().log_softmax(-1)
        otopl = lout.topk(K, dim=-1).indices
        kl_divs, topks = [], []
        for l in range(n):
            llayer = layer_logs[l].log_softmax(-1)
            kl_divs.append((llayer.exp() * (llayer - lout)).sum(-1).mean().detach())
            topks.append(llayer.topk(K, dim=-1).indices)
        real_oh = F.one_hot(otopl, vocab).sum(-2)
        overlaps = torch.stack([(F.one_hot(ot, vocab).sum(-2).unsqueeze(-2).float() @ real_oh.unsqueeze(-1).float() / K).mean() for ot in topks], dim=0)
        accu_kl_div = accu_kl_div + torch.stack(kl_divs, dim=0)
        accu_topk_overlaps = accu_topk_overlaps + overlaps
    return accu_kl_div / len(prompts), accu_topk_overlaps / len(prompts)


def port_of_analyze_norms(model, prompts, family: str = "llama"):
    """analysis/analyze_norms.py's mean relative contributions and cosines of the attention and the MLP:
    per token, the norms, their floor and h + a in the model's dtype and then cast; a cosine summed over
    a prompt's tokens in the model's dtype, then cast; all summed over every prompt's tokens and divided
    by their count. (attention, MLP, attention cosine, MLP cosine), one value per layer each."""
    names = Names(model, family)
    n = len(names.layers)
    att, mlp, att_cos_all, mlp_cos_all, cnt = 0, 0, 0, 0, 0
    for prompt in prompts:
        seen, _ = traced(model, prompt[None], names, modules=True)
        inputs = [seen[i][0] for i in range(n)]
        rel_att = [seen["att", i].norm(dim=-1).float() / inputs[i].norm(dim=-1).clamp(min=1e-6).float() for i in range(n)]
        mlp_input = [seen["att", i] + inputs[i] for i in range(n)]
        rel_mlp = [seen["mlp", i].norm(dim=-1).float() / mlp_input[i].norm(dim=-1).clamp(min=1e-6).float() for i in range(n)]
        att_cos = [F.cosine_similarity(seen["att", i], inputs[i], dim=-1).sum(1).float() for i in range(n)]
        mlp_cos = [F.cosine_similarity(seen["mlp", i], mlp_input[i], dim=-1).sum(1).float() for i in range(n)]
        att = att + torch.cat(rel_att, dim=0).sum(dim=1)
        mlp = mlp + torch.cat(rel_mlp, dim=0).sum(dim=1)
        att_cos_all = att_cos_all + torch.cat(att_cos, dim=0)
        mlp_cos_all = mlp_cos_all + torch.cat(mlp_cos, dim=0)
        cnt += prompt.shape[0]
    return att / cnt, mlp / cnt, att_cos_all / cnt, mlp_cos_all / cnt


def assert_as_their_code(use, model, windows, family: str = "llama", rel: float = 1e-4, absolute: float = 1e-5):
    """Every figure of a `--as csordas` measurement (`use`, depth-use's `DepthUse` of `windows`) against
    the ports above on the same model: the influence matrix and the output's change (maxima), the lens's
    KL and top-5 overlap and the four relative contributions and cosines (means over the windows)."""
    import pytest

    mean = lambda rows: [sum(v) / len(windows) for v in rows]  # noqa: E731
    d_max, dout_max = port_of_current_effects(model, windows, family)
    assert torch.tensor(use.influence) == pytest.approx(d_max, rel=rel, abs=absolute)
    assert use.output_change == pytest.approx(dout_max[:, 0].tolist(), rel=rel, abs=absolute / 10)
    kl, overlap = port_of_run_logitlens(model, windows, family)
    assert mean(use.lens_kl) == pytest.approx(kl.tolist(), rel=rel, abs=absolute)
    assert mean(use.lens_top5) == pytest.approx(overlap.tolist(), rel=1e-5)
    for got, want in zip((use.attn_norm, use.mlp_norm, use.attn_cos, use.mlp_cos), port_of_analyze_norms(model, windows, family)):
        assert mean(got) == pytest.approx(want.tolist(), rel=rel, abs=absolute)
