# The control plane (and the `loraplane` CLI): the base install, no torch, so the image stays small.
#
#   docker build -f deploy/control-plane.Dockerfile -t loraplane-control .
#   docker run -p 8080:8080 -e LORAPLANE_ADMIN_TOKENS=... \
#       -e LORAPLANE_DATABASE_URL=postgresql://user:pass@db/loraplane \
#       -v /srv/adapters:/adapters:ro loraplane-control control --lora-roots /adapters
#
# Tokens and the database URL come from the environment only (see control_plane/cli.py). Without
# LORAPLANE_DATABASE_URL it keeps SQLite under /home/loraplane/.loraplane (mount a volume there).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LORAPLANE_HOST=0.0.0.0 LORAPLANE_PORT=8080
RUN useradd --create-home --uid 10001 loraplane

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY control_plane/ control_plane/
COPY data_plane/ data_plane/
COPY migrations/ migrations/
# the base install: no extra, so no torch
RUN pip install --no-cache-dir . && rm -rf /src

USER loraplane
WORKDIR /home/loraplane
EXPOSE 8080
ENTRYPOINT ["loraplane"]
CMD ["control"]
