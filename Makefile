# Both entry points create or reuse .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: venv demo test bench bench-hitpath bench-hitfloor bench-digest bench-partial bench-epoch bench-allocation bench-managed bench-misspath bench-tfdata bench-balancer bench-autoorder bench-autoscale bench-autocache clean proto

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on disk; a bare `torch` may pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev,torch,gcs,s3,tf,ray]'
	touch $(STAMP)

demo: venv
	$(PY) tools/demo

# Two pytest-xdist workers: about 14-16 min on a 2-core CI machine (2284 tests; one process takes longer).
# tests/conftest.py keeps each module's tests on one worker and the Ray tests on one.
# `make test TEST_ARGS=` runs the suite in one process.
TEST_ARGS ?= -n 2 --dist loadgroup
test: venv
	$(PY) -m pytest -q $(TEST_ARGS) tests

# Each benchmark runs side by side with its peer; results go to docs/benchmarks.md.
bench: bench-hitpath bench-hitfloor bench-digest bench-partial bench-epoch bench-allocation bench-managed bench-misspath bench-tfdata bench-balancer bench-autoorder bench-autoscale bench-autocache

bench-hitpath: venv
	@command -v memcached >/dev/null || (apt-get update -qq && apt-get install -y -qq memcached)
	$(PY) tools/bench/hitpath

bench-hitfloor: venv
	$(PY) tools/bench/hitfloor

bench-digest: venv
	$(PY) tools/bench/digest

bench-partial: venv
	$(PY) tools/bench/partial

bench-epoch: venv
	@command -v memcached >/dev/null || (apt-get update -qq && apt-get install -y -qq memcached)
	$(PY) tools/bench/epoch

bench-misspath: venv
	$(PY) tools/bench/misspath

bench-tfdata: venv
	$(PY) tools/bench/tfdata

bench-balancer: venv
	$(PY) tools/bench/balancer

bench-autoorder: venv
	$(PY) tools/bench/autoorder --accuracy

bench-allocation: venv
	$(PY) tools/bench/allocation

bench-managed: venv
	$(PY) tools/bench/managed

bench-autoscale: venv
	$(PY) tools/bench/autoscale --duration 120 --window 0.5

bench-autocache: venv
	$(PY) tools/bench/autocache

proto: venv
	$(PY) tools/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
