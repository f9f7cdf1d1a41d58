# The two commands of the README:
#   make book   set up .venv, then build the book (every notebook executed, strict)
#   make test   set up .venv, then run the test suite
# Both create the environment themselves on a fresh clone; later runs reuse it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Tests and CI read Tiny Shakespeare from the workspace's shared copy when it exists,
# so they need no network; elsewhere the data module downloads and verifies it.
SHARED_DATA := $(wildcard $(abspath ..)/shared/data/tinyshakespeare.txt)
ifneq ($(SHARED_DATA),)
export DISTLAB_DATA ?= $(SHARED_DATA)
endif

.PHONY: book test lock clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and alone: a package that asks for "torch" must not pull a newer build
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build book -W -n --keep-going
	@echo "The book is in _build/html/index.html"

# two workers: the book build (one long test, started first) runs beside the rest; whole
# files go to a worker (loadfile), so the tests that read the build, all in one file, share
# one build. (Not loadgroup: with pytest 9.2 it silently stops grouping, pytest-xdist#1386.)
test: $(STAMP)
	$(BIN)/python -m pytest -v --durations=15 -n 2 --dist loadfile

# Re-resolve requirements.in into the pinned requirements.txt.
lock: $(STAMP)
	$(BIN)/pip install -r requirements.in
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > requirements.lock.tmp
	head -4 requirements.txt | cat - requirements.lock.tmp > requirements.txt
	rm requirements.lock.tmp

clean:
	rm -rf _build $(VENV)
