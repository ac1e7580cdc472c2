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
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# mlx-vlm is the L2 oracle for TurboQuant and DiffusionGemma. Its declared dependencies
	# (opencv, mlx-audio, fastapi, datasets, ...) serve its apps, not the modules we compare
	# against, which need only mlx + transformers: install it without them.
	$(PY) -m pip install -q --no-deps 'mlx-vlm==0.7.10'
	# mlx-optiq: the second reference for masked diffusion (its llada2 loop file is read by the
	# tests, never imported as a package: importing optiq patches mlx-lm).
	$(PY) -m pip install -q --no-deps 'mlx-optiq==0.7.7'
	touch $@

demo: $(VENV)/.installed
	$(PRELOAD) $(VENV)/bin/mlxbun port zoo:all

test: $(VENV)/.installed
	$(PRELOAD) $(PY) -m pytest -n $(JOBS) -q
