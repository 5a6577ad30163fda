"""LaCo's layer-collapse procedure (Yang et al., Findings of EMNLP 2024, arXiv 2402.11187;
yangyifei729/LaCo @ 8483587, `laco_llama-13b.ipynb`, the notebook's last loop), with its defaults:
from the top down, the run of `merge_layers` layers starting at `lay` is merged into its first
(`heal --methods laco`'s RDSC, here by default as the notebook computes it: what its loop ran; the
paper's sum of differences, `as=paper`, takes SmolLM2's merged weights to 4.4 times their norm
and the similarity to about 0), and the merge kept while the merged model's last hidden state stays
within the cosine `threshold` of the unpruned model's on the calibration windows; after a kept merge
`lay` steps down by `interval`, after a refused one by 1,
until `lay` passes `lowest`. Their run is cut where the model ends (`min(merge_layer_num, len -
base - 1)`), so later merges may reach the last layer.

Here the procedure stops once k layers are gone, the last merge cut to what is left of k, and
what it gives is the layers merged away (numbered as in the unpruned model): `select` judges those
as a removal on the held-out windows beside every other search; `heal --methods laco` on the same
layers gives the merged model itself. Ending with fewer than k gone is one line saying how many it
reached (lower `laco.threshold`).

Their similarity: per window, the cosine of the two last hidden states (after the final norm)
flattened over every token, averaged over windows; their sentences are five Wikipedia openings,
here the calibration windows. Their notebook's numbers are Llama2-13B's (40 layers): merge_layers
7, interval 1, threshold 0.45, lowest 0, highest the last layer."""

from __future__ import annotations

from dataclasses import dataclass

from depthcurse.errors import DepthcurseError
from depthcurse.merging import Merging, RDSC_FORMS, check_threshold, check_uniform, last_hidden, mean_similarity, merged_away, similarity_range
from depthcurse.select.search import Bound, Search
from depthcurse.surgery import find_blocks


@dataclass
class LacoSearchSettings:
    merge_layers: int = 7  # MERGE_LAYERS: a run's layers, its base included
    interval: int = 1  # INTERVAL: how far `lay` steps down after a kept merge
    threshold: float = 0.45  # THRESHOLD: the least mean cosine similarity of the last hidden states kept
    lowest: int = 0  # LOWEST_LAY
    highest: int | None = None  # HIGHEST_LAY; None: the last layer
    as_: str = "code"  # the merge the procedure runs: as the notebook computes it (what its loop ran), or `paper`, RDSC as written
    biases: bool = False  # merge the biases too; the notebook merges the seven projection weights alone


def laco_procedure(model, windows, s: LacoSearchSettings, stop_at: int | None = None, on_step=lambda text: None) -> tuple[Merging, list]:
    """The notebook's loop on `model` (left as it was); `stop_at`: end once that many layers are
    gone (None: as the notebook, to the end). The merged model and every (lay, run length, similarity, kept)."""
    blocks = find_blocks(model).layers
    n = len(blocks)
    reference = last_hidden(model, windows)
    state, trail = Merging.start(n), []
    highest = n - 1 if s.highest is None else s.highest
    lay = highest - s.merge_layers
    bound = Bound(2 * n + 4, "laco's procedure")  # each step lowers lay by 1 or more: n steps at most
    while lay >= s.lowest and (stop_at is None or len(state.gone()) < stop_at):
        bound.step(f"layer {lay}")
        m = min(s.merge_layers - 1, len(state.kept) - lay - 1)
        if stop_at is not None:
            m = min(m, stop_at - len(state.gone()))
        candidate = state.merge(blocks, lay, lay + m, RDSC_FORMS[s.as_], s.biases)
        with candidate.model(model) as merged:
            sim = mean_similarity(reference, last_hidden(merged, windows))
        trail.append((lay, m, sim, sim > s.threshold))
        on_step(f"layer {lay} with {m} above: similarity {sim:.4f}")
        if sim > s.threshold:
            state = candidate
            lay -= s.interval  # the notebook then clamps lay under len(model) - 1: never needed, a kept merge leaves lay + 1 layers at least
        else:
            lay -= 1
    return state, trail


class Laco(Search):
    name = "laco"
    title = "LaCo's layer collapse"
    source = "Yang et al. Findings of EMNLP 2024, arXiv 2402.11187; github.com/yangyifei729/LaCo @ 8483587"
    reads = "model"
    Settings = LacoSearchSettings

    def check(self, space):
        s = self.settings
        check_threshold(s.threshold, "laco")
        if s.as_ not in RDSC_FORMS:
            raise DepthcurseError(f"--search-args laco.as={s.as_}: use paper or code")
        if s.merge_layers < 2 or s.interval < 1:
            raise DepthcurseError(f"--search-args laco: merge_layers ({s.merge_layers}) must be at least 2 and interval ({s.interval}) at least 1")
        highest = space.n - 1 if s.highest is None else s.highest
        if not 0 <= s.lowest <= highest - s.merge_layers or highest >= space.n:
            raise DepthcurseError(f"--search-args laco: lowest {s.lowest}, highest {highest} and merge_layers {s.merge_layers} leave no run to merge "
                                  f"in {space.n} layers (0 <= lowest <= highest - merge_layers, highest < {space.n})")

    def run(self, ctx):
        check_uniform(ctx.model, "--search laco")
        state, trail = laco_procedure(ctx.model, ctx.calibration, self.settings, stop_at=ctx.space.k, on_step=ctx.phase)
        kept = sum(1 for t in trail if t[3])
        ctx.notes.append(f"{len(trail)} merges tried, {kept} kept; similarities {similarity_range(trail)}")
        return merged_away("laco", state, trail, ctx.space.k, self.settings.threshold)
