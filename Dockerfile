# One image for every tier; docker-compose.yml picks the service with the command.
FROM python:3.11-slim
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends build-essential make && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml Makefile ./
COPY proto ./proto
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
COPY benchmarks ./benchmarks
COPY tools ./tools
# torch==2.13.0 from plain PyPI is the CUDA build (several GB); for a CPU-only image pass
# --build-arg PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index> so pip finds the +cpu wheel.
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
# Same set-up as on a developer machine: venv, deps, generated stubs, converted model (baked into the image).
ENV TANDEM_CACHE=/models
# The CPU quantized GEMM is compiled at build time: for AVX2 + FMA, so the image runs on any x86-64-v3 machine.
# That build has no integer GEMM (kernels/cpu/qgemm_vnni.cpp needs AVX-512 VNNI, 2-4x faster on quantized
# weights); an image for machines that have it can set TANDEM_CPU_ARCH to an -march with it (icelake-server, znver4).
ENV TANDEM_CPU_ARCH=x86-64-v3
RUN make model PYTHON=python3 VENV=/venv
ENV PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 50051 8000
CMD ["tandem", "--help"]
