"""`depthcurse depth-use`: how a model uses its depth, per layer (`measure`: what each sublayer
adds, where the logit and tuned lenses settle (`tuned_lens`), whose later work a skipped layer changes), shown and written
(`report`)."""

from depthcurse.depth.measure import DepthUse, measure_depth_use, per_layer_rows, phase_transition, settling_depth
from depthcurse.depth.tuned_lens import LENS_FILE, LensSettings, TunedLens, load_lens, train_tuned_lens
from depthcurse.depth.report import depth_table, depth_verdicts, plot_influence, plot_settling, run_depth_use, write_depth

__all__ = ["DepthUse", "measure_depth_use", "per_layer_rows", "phase_transition", "settling_depth", "depth_table", "depth_verdicts",
           "plot_influence", "plot_settling", "run_depth_use", "write_depth", "LENS_FILE", "LensSettings", "TunedLens", "load_lens", "train_tuned_lens"]
