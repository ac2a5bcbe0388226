# Set-up, build, test, demo and benchmark targets.
#   make run    install everything, then run the main job
#   make test   install everything, then run the test suite
PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
STAMP       := build/stamps
TORCH_PIN   := torch==2.13.0
# Debian packages the project needs: DPDK for the software switch, Mininet and
# iproute2 for the testbed, clang for the fuzzing/sanitizer build.
DEB_PKGS    := libdpdk-dev dpdk pkg-config libpcap-dev build-essential mininet \
               iproute2 tcpdump ethtool clang libclang-rt-14-dev
PYTEST_ARGS ?=
# The main job: THC in-network training (N workers + the reference aggregator) vs fp32.
MAIN_JOB    ?= host.experiments.main_job

.PHONY: setup sysdeps venv build native run demo test bench clean p4 testbed

setup: sysdeps venv build

sysdeps: $(STAMP)/sysdeps
$(STAMP)/sysdeps:
	@mkdir -p $(STAMP)
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing Debian packages (install them as root): $$missing"; exit 1; \
	  fi; \
	fi
	@touch $@

venv: $(STAMP)/venv
$(STAMP)/venv: pyproject.toml
	@mkdir -p $(STAMP)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch when none is installed (a bare "torch" pulls CUDA).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIN)
	# NVIDIA's compiler wheels (extra cuda-compile) where the platform has them; without
	# them the PTX test skips.
	$(PIP) install -q -e '.[dev,cuda-compile]' || { echo "CUDA compiler wheels not installed (no wheel for this platform?): the PTX test will skip"; $(PIP) install -q -e '.[dev]'; }
	@touch $@

build: sysdeps native
	@if [ -f dataplane/dpdk/Makefile ]; then $(MAKE) -C dataplane/dpdk; fi

# The worker's native data path (host/native/__init__.py loads it with ctypes).
NATIVE_SRC  ?= host/native/datapath.c
NATIVE_SO   ?= host/native/_datapath.so
native: $(NATIVE_SO)
$(NATIVE_SO): $(NATIVE_SRC)
	$(CC) -O2 -g -Wall -Wextra -fPIC -shared -o $@ $<

run: setup
	$(PY) -m $(MAIN_JOB)

demo: setup
	$(PY) -m host.experiments.codec_demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m host.experiments.codec_bench nmse
	$(PY) -m host.experiments.codec_bench speed
	$(PY) -m host.experiments.bench_udp --json build/bench_udp.json --plot build/bench_udp.png

# BMv2 program (p4c is not packaged for Debian: build p4lang/p4c, see p4src/v1model/README.md).
p4:
	@command -v p4c >/dev/null || { echo "p4c is not installed: see p4src/v1model/README.md"; exit 1; }
	mkdir -p build/p4
	p4c --target bmv2 --arch v1model --p4runtime-files build/p4/main.p4info.txtpb \
	    -o build/p4 p4src/v1model/main.p4

# Mininet testbed (root): 3 workers through the best switch available here.
testbed: setup
	$(PY) -m host.experiments.testbed --hosts 3

clean:
	rm -rf build $(VENV) *.egg-info $(NATIVE_SO)
	@if [ -f dataplane/dpdk/Makefile ]; then $(MAKE) -C dataplane/dpdk clean; fi
