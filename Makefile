# kvswitch: `make demo` and `make test` work on a fresh Linux machine with Python 3.11+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A CPU build of torch is enough for everything but the GPU benchmarks.
TORCH ?= torch==2.13.0
# Test processes: most tests wait on the processes they start more than they compute, so two
# share two cores well. A test file runs whole in one of them (its fixtures made once).
TEST_WORKERS ?= 2

.PHONY: demo test lint proto bench images clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvswitch demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

proto: $(STAMP)
	$(BIN)/python proto/codegen.py

bench: $(STAMP)
	mkdir -p out
	$(BIN)/kvswitch bench hash --json out/bench_hash.json
	$(BIN)/kvswitch bench pool --json out/bench_pool.json
	$(BIN)/kvswitch bench ttft --json out/bench_ttft.json
	$(BIN)/kvswitch bench decode --json out/bench_decode.json
	$(BIN)/kvswitch bench index --backend memory --json out/bench_index_memory.json
	$(BIN)/kvswitch bench index --backend redis --json out/bench_index_redis.json
	$(BIN)/kvswitch bench router --json out/bench_router.json
	$(BIN)/kvswitch bench lookup --json out/bench_lookup.json
	$(BIN)/kvswitch bench step --json out/bench_step.json
	$(BIN)/kvswitch bench admission --json out/bench_admission.json
	$(BIN)/kvswitch bench http --json out/bench_http.json
	$(BIN)/kvswitch bench startup --json out/bench_startup.json
	$(BIN)/kvswitch bench transfer --json out/bench_transfer.json
	$(BIN)/kvswitch bench routing --plots out/routing --json out/bench_routing.json

# The images the compose files run (needs a Docker engine); docs/DEPLOY.md.
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
images:
	docker build -f deploy/Dockerfile --target router -t kvswitch-router .
	docker build -f deploy/Dockerfile --target worker -t kvswitch-worker .
	docker build -f deploy/Dockerfile --target worker \
		--build-arg TORCH_INDEX_URL=$(CPU_TORCH_INDEX) -t kvswitch-worker-cpu .

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .hypothesis
