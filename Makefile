# Two commands on a fresh machine (see README): `make demo` and `make test`.
# Both create .venv and install trainq with its training stack first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# These machines keep a CPU build of torch on local disk; the pins make pip take it
# (an unpinned torch pulls a multi-GB CUDA build). Elsewhere: make PIP_CONSTRAINT= demo
PIP_CONSTRAINT ?= .ci/constraints.txt

.PHONY: demo test lint bench setup clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(PIP_CONSTRAINT),-c $(PIP_CONSTRAINT)) -e '.[train,test,lightning,serve,dev]'
	touch $@

demo: setup
	$(VENV)/bin/trainq demo

# mypy reads the package under its installed name (trainq.watcher...): build/mypy/trainq/ links to its folders
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	mkdir -p build/mypy/trainq
	for d in watcher trainer schemas; do ln -sfn ../../../$$d build/mypy/trainq/$$d; done
	$(VENV)/bin/mypy

test: setup lint
	bash .ci/system-deps
	bash .ci/pytest

bench: setup
	$(PY) bench/run_all.py

clean-demo:
	rm -rf queue/demo queue/inbox/*.yaml queue/pending/* queue/running/* queue/done/* queue/failed/* queue/status.json queue/status.html queue/watcher.log
