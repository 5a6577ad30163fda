"""Which quantity each of depth-use's instruments computes: ours (`depthcurse`, the default) or its
anchor's own (`csordas`: robertcsordas/llm_effective_depth, the author's commits as read in the fork
ShayanTalaei/llm_effective_depth @ e757a77: `analysis/logitlens.py`, `analysis/analyze_future_effects.py`'s
`test_effect` as `analysis/analyze_current_effects.py` calls it). `depthcurse depth-use --as NAME`.

Each field is one choice that changes a number, and docs/depth-use.md has the table of them. Every
record keeps the name and the choices, and `report` refuses to set two definitions side by side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from depthcurse.errors import DepthcurseError


@dataclass(frozen=True)
class Definitions:
    name: str
    # the logit (and tuned) lens: which stream each row reads ("after" layer l, its last row the
    # output itself; or "entering" layer l, its first row the embedding's output), the direction of
    # its KL, and its top-5 figure ("contains": the output's top-1 among the lens's top 5;
    # "overlap": |top-5 of the lens and of the output| / 5)
    lens_reads: str
    lens_kl: str
    top5: str
    # a skipped layer: the first position it is skipped at (their code keeps the first token), how
    # each figure is reduced over a window's tokens and then over windows ("mean", with a t interval
    # over windows; "max": no interval), and how the output's change is scored ("kl": KL(output ||
    # skipped); "l2": the L2 norm of the change of the output's probabilities)
    skip_from: int
    reduce: str
    output_change: str
    # whether a skip's row holds the skipped layer itself and the layers before it (theirs: 0 before,
    # its own change on the diagonal) or only the later layers (NaN elsewhere)
    diagonal: bool
    # the floor under a norm that divides (their `clamp(min=1e-6)`)
    norm_floor: float
    source: str
    # a sublayer's contribution: "stream" (what the block adds to its stream: after Gemma's, OLMo 2's
    # and GLM-4's post-norms, times Granite's residual multiplier) or "modules" (their
    # `layer.self_attn.output[0]` and `layer.mlp.output`: the modules' outputs, before any of that)
    contributions: str
    # the logit lens's logits: "model" (the model's own output rule: Granite's and Cohere's logit
    # scales, Gemma 2's soft-cap) or "raw" (their `lm_head(norm(h))`, none of those)
    lens_logits: str
    # where norms and cosines are taken: "float32" (cast first) or "model" (theirs: in the model's
    # dtype, then cast; a cosine summed over a window's tokens in that dtype too)
    norms_in: str

    def summary(self) -> dict:
        return asdict(self)

    def row_label(self, row: int, layers: int) -> str:
        """What the lens's row `row` reads."""
        if self.lens_reads == "after":
            return f"after layer {row}"
        return "the output" if row == layers else ("the embedding" if row == 0 else f"entering layer {row}")

    @property
    def kl_label(self) -> str:
        return "KL(output || lens)" if self.lens_kl == "output||lens" else "KL(lens || output)"

    @property
    def top5_label(self) -> str:
        return "output's top-1 in the lens's top-5" if self.top5 == "contains" else "top-5 overlap with the output's"

    @property
    def change_label(self) -> str:
        return "KL(output || skipped)" if self.output_change == "kl" else "||p_skipped - p||_2"


DEFINITIONS = {
    "depthcurse": Definitions("depthcurse", lens_reads="after", lens_kl="output||lens", top5="contains", skip_from=0, reduce="mean",
                              output_change="kl", diagonal=False, norm_floor=1e-12, contributions="stream", lens_logits="model",
                              norms_in="float32", source="depthcurse (docs/depth-use.md)"),
    "csordas": Definitions("csordas", lens_reads="entering", lens_kl="lens||output", top5="overlap", skip_from=1, reduce="max",
                           output_change="l2", diagonal=True, norm_floor=1e-6, contributions="modules", lens_logits="raw", norms_in="model",
                           source="Csordás, Manning and Potts 2025, robertcsordas/llm_effective_depth (read in ShayanTalaei/llm_effective_depth "
                                  "@ e757a77): analysis/logitlens.py, analysis/analyze_current_effects.py, "
                                  "analysis/analyze_norms.py"),
}


def find_definitions(name: str) -> Definitions:
    try:
        return DEFINITIONS[name]
    except KeyError:
        raise DepthcurseError(f"--as {name}: no such definitions (known: {', '.join(DEFINITIONS)})") from None


def definitions_name(record: dict) -> str:
    """The name of the definitions a depth-use or depth-map record was measured by (a record from before they were kept: ours)."""
    return (record.get("definitions") or {}).get("name", "depthcurse")


def definitions_of(record: dict) -> Definitions:
    """The definitions a depth-use record was measured by."""
    return find_definitions(definitions_name(record))


def same_definitions(records: list[dict], names: list[str], what: str = "runs") -> str:
    """The one definitions' name several records (depth-use runs, or depth maps) were measured by, or
    one line naming two that differ: figures of two definitions are other quantities, never set side by side."""
    found = [definitions_name(r) for r in records]
    for name, d in zip(names, found):
        if d != found[0]:
            raise DepthcurseError(f"{what} of two definitions: {names[0]} by the {found[0]} definitions, {name} by the {d} ones; their figures are "
                                  "other quantities, not set side by side (rerun one with --as)")
    return found[0] if found else "depthcurse"
