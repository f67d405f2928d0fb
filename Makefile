# Set-up and everyday commands. Everything installs into a project-local virtual environment.
# On a machine without torch the CPU build torch==2.13.0 is pinned; where torch is already
# installed system-wide (GPU machines) the venv sees it and keeps it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run serve chat test lint bench clean

$(STAMP): pyproject.toml Makefile scripts/install.sh clients/package-lock.json
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dflash serve

serve: run

chat: $(STAMP)
	$(VENV)/bin/dflash chat

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info clients/node_modules
