"""`lns-train`: pre-train the papers' comparison models, any normalisation, one GPU or many.

The public face: `TrainConfig` (what a run is) and the report that compares runs (`read_run`,
`table1`, `seed_groups`, `seeds_table`, `incomparable`, `write_compare`); `depthcurse.train.loop.run` trains or resumes a run. The face loads
no torch (the command line builds its `lns-train` options from `TrainConfig` at start-up); how
the trainer's parts compose is in `loop`.
"""

from depthcurse.train.config import TrainConfig
from depthcurse.train.report import incomparable, read_run, seed_groups, seeds_table, table1, write_compare

__all__ = ["TrainConfig", "incomparable", "read_run", "seed_groups", "seeds_table", "table1", "write_compare"]
