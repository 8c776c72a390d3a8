# The two set-up commands of the README. Each installs what it needs (idempotent),
# builds and runs. CI runs `make test` (see .ci/run).

PYTHON ?= python3
CARGO ?= cargo
PLUGIN_PKG := xla-cpu-pjrt==0.0.1
FMNIST_DIR := /usr/share/datasets/fashion-mnist
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test deps

# The XLA CPU PJRT plugin (pip), Fashion-MNIST and a C compiler (Debian).
deps:
	@$(PYTHON) -m pip show xla-cpu-pjrt 2>/dev/null | grep -q '^Version: 0.0.1$$' \
		|| $(PYTHON) -m pip install --quiet $(PLUGIN_PKG)
	@if [ ! -f $(FMNIST_DIR)/train-images-idx3-ubyte.gz ] || ! command -v cc >/dev/null; then \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q dataset-fashion-mnist gcc; fi

# kiln's main job: train the Fashion-MNIST MLP on the default CPU backend.
run: deps
	$(CARGO) run --release --bin kiln -- train mlp --epochs 8

# The whole test suite (release: some tests train), after checking the layout and
# the lints (clippy, warnings as errors). Clippy checks the release profile too, so
# that it shares build scripts and proc macros with the tests' build (a fresh
# clone's target/ is 1.1 GB instead of 1.7 GB: CI's disk is small).
test: deps
	@if $(CARGO) fmt --version >/dev/null 2>&1; then $(CARGO) fmt --all --check; \
		else echo "rustfmt is not installed: the layout check is skipped"; fi
	@if $(CARGO) clippy --version >/dev/null 2>&1; then $(CARGO) clippy --release --workspace --all-targets -- -D warnings; \
		else echo "clippy is not installed: the lint check is skipped"; fi
	$(CARGO) test --workspace --release
