# The two commands of the README:
#   make book   set up .venv, then build the book (every notebook executed, strict)
#   make test   set up .venv, then run the test suite
# Both create the environment themselves on a fresh clone; later runs reuse it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book book-fresh test test-under-load test-gpu gpu-check lint browser vendor lock clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and alone: a package that asks for "torch" must not pull a newer build
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

# Strict, with Jupyter Book's execution cache (_config.yml): first the pages whose code cells
# changed are executed, several at once (distlab.infra.book_build: Jupyter Book alone runs them
# one after another), into that cache; the build then reads every page from it; last, each
# page's execution time, slowest first. A change under src/ is not seen by the cache:
# `make book-fresh` executes every page from scratch, as `make test` and CI always do.
# Pinned to the CPU, on a machine with GPUs too, so the book shows the same results everywhere:
# DISTLAB_DEVICE=cpu makes every `--device auto` the CPU, and the empty CUDA_VISIBLE_DEVICES
# hides the GPUs from every process (`make test` does the same in tests/conftest.py).
ON_CPU := DISTLAB_DEVICE=cpu CUDA_VISIBLE_DEVICES=
book: $(STAMP)
	$(ON_CPU) $(BIN)/python -m distlab.infra.book_build execute
	$(ON_CPU) $(BIN)/jupyter-book build book -W -n --keep-going
	@$(BIN)/python -m distlab.infra.book_build times
	@echo "The book is in _build/html/index.html"

book-fresh:
	rm -rf _build/html _build/jupyter_execute _build/.doctrees _build/.jupyter_cache
	$(MAKE) book

# ruff's lint and format check over the tree (tests/book/test_lint.py runs the same in `make test`);
# `$(BIN)/ruff format src tests && $(BIN)/ruff check --fix src tests` applies them
lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

# two workers: the book build (one long test, started first; it executes two pages at a time)
# runs beside the rest; whole files go to a worker (loadfile), and tests/conftest.py schedules
# the two files that read the build (the notebook and browser tests) as one, so one worker
# builds once and the other is never blocked. (Not loadgroup: with pytest 9.2 it silently stops
# grouping, pytest-xdist#1386.) The summary ends with each page's execution time.
# The tests run pinned to the CPU (tests/conftest.py) and leave out the GPU tests (`-m 'not gpu'`
# in pyproject.toml); `pytest -m gpu` runs those on a machine with CUDA GPUs.
test: $(STAMP) browser
	DISTLAB_CHROMIUM="$(CHROMIUM)" $(BIN)/python -m pytest -v --durations=15 -n 2 --dist loadfile

# The suite as a loaded CI machine runs it: a busy loop holds one core the whole time, and
# the suite must pass TIMES times in a row (CONTRIBUTING.md: run it so before resolving).
TIMES ?= 3
test-under-load: $(STAMP) browser
	@$(BIN)/python -c "while True: pass" & busy=$$!; trap "kill $$busy" EXIT; \
	for i in $$(seq $(TIMES)); do \
	  echo "== make test under load: run $$i of $(TIMES) (a busy loop, pid $$busy, holds a core)"; \
	  $(MAKE) --no-print-directory test || exit 1; \
	done

# Where GPUs are. These two run with this venv's python when `make test` made one, else with
# the machine's own python3 and its preinstalled CUDA torch (a GPU machine often reaches no
# package registry): they install nothing. `make test-gpu GPU_PY=/path/to/python` picks
# another. distlab.bench.gpu_check --environment prints torch's and accelerate's versions
# against the pins first; a skew is reported, not refused.
GPU_PY  ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_RUN := PYTHONPATH="$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PY)

# The opt-in GPU suite (tests/gpu/): labs 1-6 on CUDA/NCCL against lab 1, a GPU checkpoint resumed
# elsewhere, lab 6's FSDP2 policy, the ring on NCCL. `make test` deselects it (pyproject addopts);
# without CUDA every test is skipped with its reason.
test-gpu:
	@$(GPU_RUN) -m distlab.bench.gpu_check --environment
	$(GPU_RUN) -m pytest -m gpu -v -rs -p no:cacheprovider tests/gpu

# The GPU check, once per GPU machine (about 10 minutes on one H100): the environment, the
# GPU suite, lab 1 on gpt2 in bf16 eager and compiled, lab 4 on one GPU, a profile of one lab 4
# step; into results/gpu_check/<gpu>_<date>/ with provenance (distlab/bench/gpu_check.py).
gpu-check:
	$(GPU_RUN) -m distlab.bench.gpu_check

# The browser tests drive Debian's Chromium through playwright (never a browser that playwright
# downloads). Installed here when missing, with apt-get; elsewhere pass your own build:
#   make test CHROMIUM="/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "make test: the browser tests need Chromium or Chrome; none at $(CHROMIUM)."; \
	    echo "Install one and run: make test CHROMIUM=/path/to/chromium"; exit 1; fi; \
	  echo "Installing Debian's chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	fi

# The JavaScript the built pages run, served by the book itself (book/_vendor), so that no page
# loads code from a CDN: ipywidgets' HTML manager, RequireJS and MathJax, from the npm registry
# at pinned versions. Rerun after changing a version; book/_vendor/SOURCES.md lists them.
WIDGETS_JS := @jupyter-widgets/html-manager@1.0.15
REQUIRE_JS := requirejs@2.3.8
MATHJAX    := mathjax@3.2.2
vendor:
	rm -rf _build/vendor && mkdir -p _build/vendor
	cd _build/vendor && npm pack --silent $(WIDGETS_JS) $(REQUIRE_JS) $(MATHJAX) >/dev/null
	cd _build/vendor && for t in *.tgz; do mkdir -p "$${t%.tgz}" && tar xzf "$$t" -C "$${t%.tgz}"; done
	rm -rf book/_vendor/jupyter-widgets book/_vendor/mathjax book/_vendor/require.js
	mkdir -p book/_vendor/jupyter-widgets book/_vendor/mathjax/output/chtml/fonts/woff-v2
	cp _build/vendor/jupyter-widgets-html-manager-*/package/dist/embed-amd.js \
	   _build/vendor/jupyter-widgets-html-manager-*/package/dist/*.woff* _build/vendor/jupyter-widgets-html-manager-*/package/dist/*.ttf \
	   _build/vendor/jupyter-widgets-html-manager-*/package/dist/embed.js.LICENSE.txt book/_vendor/jupyter-widgets/
	cp _build/vendor/requirejs-*/package/require.js book/_vendor/
	cp _build/vendor/mathjax-*/package/es5/tex-mml-chtml.js _build/vendor/mathjax-*/package/LICENSE book/_vendor/mathjax/
	cp _build/vendor/mathjax-*/package/es5/output/chtml/fonts/woff-v2/*.woff book/_vendor/mathjax/output/chtml/fonts/woff-v2/

# Re-resolve requirements.in into the pinned requirements.txt.
lock: $(STAMP)
	$(BIN)/pip install -r requirements.in
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > requirements.lock.tmp
	head -4 requirements.txt | cat - requirements.lock.tmp > requirements.txt
	rm requirements.lock.tmp

clean:
	rm -rf _build $(VENV)
