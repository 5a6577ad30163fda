"""The statistics every comparison rests on, as pure functions of numbers: intervals honest at
the n they have (`intervals`: Student's t, Welch-Satterthwaite (paired groups, or two independent samples), Wilson, the delta method), paired
bootstrap intervals refused below the items they need (`bootstrap`), and the two-way
decomposition of a grid's spread (`decomposition`), and the word a comparison prints from its interval
(`verdicts`). No torch: `make mutate` mutates them with
fast tests."""

from depthcurse.stats.bootstrap import MIN_ITEMS, TooFewItems, resample
from depthcurse.stats.decomposition import decided_by, shares
from depthcurse.stats.verdicts import CANNOT_TELL, agreement_word, difference_word
from depthcurse.stats.intervals import (CONFIDENCE, UNPAIRED, Spread, apart, difference_interval, independent_spread, interval, mean, mean_interval,
                                        paired_spread, ratio_interval, t_quantile, welch_interval, wilson)

__all__ = ["CANNOT_TELL", "agreement_word", "difference_word", "MIN_ITEMS", "TooFewItems", "resample", "decided_by", "shares", "CONFIDENCE", "UNPAIRED", "Spread", "apart", "difference_interval",
           "independent_spread", "interval", "mean", "mean_interval", "paired_spread", "ratio_interval", "t_quantile", "welch_interval", "wilson"]
