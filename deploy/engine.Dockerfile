# An engine: the base install plus the engine extra (torch, safetensors, tokenizers, ...).
#
#   docker build -f deploy/engine.Dockerfile -t loraplane-engine .
#   # CUDA instead of the CPU build of torch (the index of the wheels that match your driver):
#   docker build -f deploy/engine.Dockerfile --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t loraplane-engine:cuda .
#   docker run -p 8000:8000 -v /srv/models/base:/models/base:ro loraplane-engine \
#       engine /models/base --host 0.0.0.0 --enable-lora
#
# g++ stays in the image: the engine compiles its CPU kernels (LoRA BGMV, decode attention) on first use
# against the installed torch, into LORAPLANE_KERNEL_BUILD_DIR (data_plane/model/cpu_extension.py);
# without a compiler it falls back to the slower torch ops.
# torch is installed first, from TORCH_INDEX_URL, at the version pyproject.toml pins (a test checks they
# agree); `pip install .[engine]` then finds it satisfied instead of pulling the default (CUDA) build.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 loraplane
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY control_plane/ control_plane/
COPY data_plane/ data_plane/
COPY migrations/ migrations/
RUN pip install --no-cache-dir ".[engine]" && rm -rf /src

USER loraplane
WORKDIR /home/loraplane
EXPOSE 8000
ENTRYPOINT ["loraplane"]
CMD ["engine", "--help"]
