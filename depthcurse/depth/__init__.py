"""`depthcurse depth-use`: how a model uses its depth, per layer (`measure`: what each sublayer
adds, where the logit and tuned lenses settle (`tuned_lens`), whose later work a skipped layer changes), shown and written
(`report`), and set against `select`'s exact answers (`agreement`)."""

from depthcurse.depth.measure import DepthUse, measure_depth_use, per_layer_rows, phase_transition, settling_depth
from depthcurse.depth.tuned_lens import LENS_FILE, LensSettings, TunedLens, load_lens, train_tuned_lens
from depthcurse.depth.agreement import agreement, layer_measures, select_targets
from depthcurse.depth.report import (KEPT_FILE, agreement_table, depth_table, depth_verdicts, kept_summary, plot_influence, plot_settling, read_selects,
                                     run_depth_use, write_depth)

__all__ = ["DepthUse", "measure_depth_use", "per_layer_rows", "phase_transition", "settling_depth", "depth_table", "depth_verdicts",
           "plot_influence", "plot_settling", "run_depth_use", "write_depth", "LENS_FILE", "LensSettings", "TunedLens", "load_lens", "train_tuned_lens", "agreement", "agreement_table", "layer_measures", "read_selects", "select_targets", "KEPT_FILE", "kept_summary"]
