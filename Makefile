# Two commands do all the set-up on a fresh machine (idempotent):
#   make demo   the main job: DeepWalk on WordNet, embedded
#   make test   the test suite (compiled kernels, then what differs on the reference twins)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.distemb-installed
APT    := openmpi-bin libopenmpi-dev wordnet-base openssh-server
export OMP_WAIT_POLICY ?= passive

.PHONY: test demo bench data system clean docs

$(PY):
	python3 -m venv $(VENV)

# Debian packages: MPI for the mpirun tests, WordNet for the graph examples, an sshd for
# the test of DGL's own launcher (which starts every process through ssh; the test runs
# its own sshd on 127.0.0.1). The install starts no service: while it runs, a temporary
# /usr/sbin/policy-rc.d answers 101 ("action forbidden"), which Debian's maintainer
# scripts ask before starting one (invoke-rc.d, deb-systemd-invoke), so no system sshd
# comes up on port 22; a policy-rc.d already there is left as it is. With systemd, the
# ssh units a fresh openssh-server enabled are disabled again (no sshd at the next boot).
# POLICY_RC and SYSTEMD_DIR are variables only so that tests/test_make_system.py can
# check all this without touching the machine.
POLICY_RC   ?= /usr/sbin/policy-rc.d
SYSTEMD_DIR ?= /run/systemd/system
data: system

system:
	@missing=$$(for p in $(APT); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done | tr '\n' ' '); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  echo "installing Debian packages: $$missing"; \
	  ours=; \
	  if [ ! -e $(POLICY_RC) ] && printf '#!/bin/sh\n# made by distemb make system for one apt-get install: start no service\nexit 101\n' \
	       | $$SUDO tee $(POLICY_RC) >/dev/null && $$SUDO chmod 755 $(POLICY_RC); then ours=1; \
	    trap '$$SUDO rm -f $(POLICY_RC)' EXIT; trap 'exit 130' INT TERM; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null \
	  || echo "warning: could not install $$missing (MPI/WordNet/sshd tests will skip with a reason)"; \
	  if [ -n "$$ours" ]; then $$SUDO rm -f $(POLICY_RC); trap - EXIT INT TERM; fi; \
	  case " $$missing " in *" openssh-server "*) \
	    if [ -d $(SYSTEMD_DIR) ]; then $$SUDO systemctl disable --quiet ssh.service ssh.socket 2>/dev/null || true; fi;; \
	  esac; \
	fi

# Every source of the compiled kernels: an edited header, rule table or generator rebuilds.
KERNEL_SOURCES := $(wildcard csrc/*.pyx csrc/*.h csrc/*.py csrc/cuda/*.cu csrc/cuda/*.cuh \
                    csrc/cuda/*.h) distemb/kernels/rule_table.py

$(STAMP): $(PY) setup.py setup.cfg pyproject.toml $(KERNEL_SOURCES) | system
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dgl,mpi,examples,docs,pyg]'
	$(MAKE) --no-print-directory pyg-companions
	touch $(STAMP)

# PyG's compiled companions (its samplers and NeighborLoader need them; the extra `pyg`
# is PyG itself, pure Python). They are source releases that compile against the torch
# installed here (~12 and ~7 minutes on 2 cores), so each is built once into a wheel
# cache outside the checkout, per torch version, and installed from there: neither
# `make test` nor CI compiles them again on a machine that has them. Built without
# build isolation (isolation would download a CUDA torch of several GB) and niced.
WHEELS      ?= $(HOME)/.cache/distemb/wheels/torch-2.13.0
COMPANIONS  := torch_scatter==2.1.2 torch_sparse==0.6.18
.PHONY: pyg-companions
pyg-companions: $(PY)
	@mkdir -p $(WHEELS); \
	for spec in $(COMPANIONS); do \
	  name=$${spec%%==*}; ver=$${spec##*==}; \
	  if ! ls $(WHEELS)/$$name-$$ver-*.whl >/dev/null 2>&1; then \
	    echo "building $$spec into $(WHEELS) (once; minutes)"; \
	    nice -n 10 $(PY) -m pip wheel -q --no-build-isolation --no-deps \
	      "$$(echo $$name | tr _ -)==$$ver" -w $(WHEELS) || exit 1; \
	  fi; \
	done; \
	$(PY) -m pip install -q --no-index --no-deps --find-links $(WHEELS) $(COMPANIONS)

# The suite on TEST_WORKERS parallel workers (most tests wait on processes and sockets;
# tests/conftest.py groups those sharing a cluster, and the process-heavy ones into
# lanes), then the twin pass: what can differ without the compiled kernels (the tests
# marked `twin` in tests/conftest.py) on their numpy twins.
# Bytecode is written even where $$PYTHONDONTWRITEBYTECODE is set: the suite starts
# hundreds of Python processes, and without __pycache__ each compiles the checkout's
# modules again (and each worker rewrites every test module's asserts again).
TEST_WORKERS ?= 3
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(PYTEST_PARALLEL)
	PYTHONDONTWRITEBYTECODE= DISTEMB_NO_EXT=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) -m twin

# The documentation site (mkdocs; API reference from the docstrings) into site/; any
# warning (a broken link or anchor, a docstring griffe cannot read) fails the build.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

demo: $(STAMP)
	$(PY) graph_examples/deepwalk.py --dataset wordnet --out out/deepwalk-wordnet

# The side-by-side measurements: each prints its table and writes its run into
# benchmarks/results/<script>.json, which docs/performance.md reads (benchmarks/README.md).
bench: $(STAMP)
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_kvstore.py --dgl
	$(PY) benchmarks/bench_deepwalk.py --dataset wordnet

clean:
	rm -rf build *.egg-info distemb/*.so csrc/*.cpp
