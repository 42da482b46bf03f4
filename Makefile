# Set-up is automatic: the first `make run` or `make test` creates .venv from
# uv.lock (uv itself is installed into .tools/ with pip). The lock pins a
# torch/torchvision pair from the package index that import and run together
# on CPU (and use a GPU where there is one).
PYTHON ?= python3
UV_VERSION := 0.13.8
UV := .tools/bin/uv
# Trust the operating system's CA store (proxies with their own CA, as here).
export UV_SYSTEM_CERTS := 1
export FLWR_DISABLE_UPDATE_CHECK := 1

.PHONY: run test test-flower-next test-torch-ends lint format docs clean

run: .venv/.synced
	.venv/bin/pollen run .

# Two workers (pytest-xdist), the tests that wait longest handed out first
# (tests/conftest.py); tests that share a module's deployment stay together
# (`xdist_group`). The 15 slowest tests are listed at the end.
PYTEST_PARALLEL := -n 2 --dist loadgroup --no-loadscope-reorder

test: .venv/.synced
	.venv/bin/ruff check pollen tests benchmarks
	.venv/bin/ruff format --check pollen tests benchmarks
	.venv/bin/pytest -q $(PYTEST_PARALLEL) --durations=15

# The unit tests and one deployment (`flower_next`) on Flower's next release
# (flower-next.txt: its nightly, flwr-nightly, until it ships; then flwr
# itself), in a second environment: every other package as uv.lock pins it,
# and the Flower that flower-next.txt names in place of the locked flwr (flwr
# and flwr-nightly install the same package, `flwr`: the environment must
# hold exactly one of them). CI runs it after `make test`.
FLOWER_NEXT := .venv-flower-next

test-flower-next: $(FLOWER_NEXT)/.synced
	$(FLOWER_NEXT)/bin/pytest -q $(PYTEST_PARALLEL) -p no:cacheprovider \
		-m "not integration or flower_next"

$(FLOWER_NEXT)/.synced: uv.lock pyproject.toml flower-next.txt | $(UV)
	rm -rf $(FLOWER_NEXT)
	$(UV) venv --quiet $(FLOWER_NEXT)
	$(UV) export --quiet --locked --no-hashes --no-emit-project --all-groups --all-extras \
		| grep -v '^flwr==' > $(FLOWER_NEXT)/locked-but-flower.txt
	$(UV) pip install --quiet --compile-bytecode --python $(FLOWER_NEXT) \
		-r $(FLOWER_NEXT)/locked-but-flower.txt -r flower-next.txt
	$(UV) pip install --quiet --python $(FLOWER_NEXT) --no-deps --editable .
	$(FLOWER_NEXT)/bin/python -c "from importlib.metadata import distributions; \
		flowers = sorted({d.metadata['Name'] for d in distributions()} & {'flwr', 'flwr-nightly'}); \
		assert len(flowers) == 1, f'expected one of flwr and flwr-nightly, found {flowers}'"
	touch $@

# The unit tests at both ends of the torch range pyproject.toml declares, each
# in an environment of its own (.venv-torch-VERSION: every other package as
# uv.lock pins it). Not in CI: each end is several GB of CUDA wheels.
TORCH_ENDS := 2.7.0,0.22.0 2.15.0,0.29.2

test-torch-ends: | $(UV)
	set -e; for pair in $(TORCH_ENDS); do \
		torch=$${pair%,*}; vision=$${pair#*,}; env=.venv-torch-$$torch; \
		rm -rf $$env; $(UV) venv --quiet $$env; \
		$(UV) export --quiet --locked --no-hashes --no-emit-project --all-groups \
			--all-extras --prune torch --prune torchvision > $$env/locked-but-torch.txt; \
		$(UV) pip install --quiet --python $$env -r $$env/locked-but-torch.txt \
			torch==$$torch torchvision==$$vision; \
		$(UV) pip install --quiet --python $$env --no-deps --editable .; \
		$$env/bin/python -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"; \
		$$env/bin/pytest -q $(PYTEST_PARALLEL) -p no:cacheprovider -m "not integration"; \
	done

docs: .venv/.synced  # the documentation site, into site/ (warnings are errors; the tutorials run, about 2 min)
	NO_MKDOCS_2_WARNING=1 POLLEN_DOCS_EXECUTE=true .venv/bin/mkdocs build --strict

lint: .venv/.synced
	.venv/bin/ruff check pollen tests benchmarks

format: .venv/.synced
	.venv/bin/ruff format pollen tests benchmarks
	.venv/bin/ruff check --fix pollen tests benchmarks

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

.venv/.synced: uv.lock pyproject.toml | $(UV)
	$(UV) sync --locked --compile-bytecode
	.venv/bin/python -c "import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.ones(1), 0.5)"
	touch $@

clean:
	rm -rf .venv $(FLOWER_NEXT) .venv-torch-* .tools
