# syntax=docker/dockerfile:1
# wowd container image: multi-stage; the final stage has no compilers and runs as a non-root user.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/wowd
COPY pyproject.toml requirements.lock README.md ./
COPY wowd ./wowd
# Runtime dependencies pinned by the lock file (its test/bench extras are not installed), then
# their bytecode, compiled here because the image runs with a read-only root file system (as the
# Kubernetes manifests run it): hash-checked, so it does not depend on the files' times.
RUN /opt/wowd/bin/pip install --no-compile --constraint requirements.lock . \
 && /opt/wowd/bin/python -m compileall -q -j 0 --invalidation-mode checked-hash /opt/wowd/lib

FROM ${PYTHON_IMAGE}
# VERSION, SOURCE and REVISION are passed by `make image` (from wowd/__init__.py and git); a build
# without them labels the image with what is known and leaves the others empty, never invented.
ARG VERSION=0.1.0
ARG SOURCE=""
ARG REVISION=""
LABEL org.opencontainers.image.title="wowd" \
      org.opencontainers.image.description="Worker daemon for Wow-style event-sourced bounded contexts" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}"
# The standard library's bytecode too, where the base image left it out (compileall skips what is
# compiled already).
RUN groupadd --system --gid 10001 wowd \
 && useradd --system --uid 10001 --gid wowd --home-dir /var/lib/wowd --create-home --shell /usr/sbin/nologin wowd \
 && python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
COPY --from=build /opt/wowd /opt/wowd
# What a replica writes: the embedded file (and its -wal and -shm) in /var/lib/wowd, a volume, and
# SQLite's and Python's temporary files in /tmp. Nothing else: no bytecode at run time
# (PYTHONDONTWRITEBYTECODE), so the root file system may be read-only with those two mounted.
ENV PATH=/opt/wowd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    WOWD_EMBEDDED__PATH=/var/lib/wowd/wowd.db \
    WOWD_HTTP__HOST=0.0.0.0 \
    WOWD_HTTP__PORT=9180
USER 10001:10001
WORKDIR /var/lib/wowd
VOLUME ["/var/lib/wowd"]
EXPOSE 9180
# Liveness only: /readyz (functioning) is for orchestrators and the compose file.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os,sys,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('WOWD_HTTP__PORT', '9180'), timeout=2); sys.exit(0)"]
STOPSIGNAL SIGTERM
# `docker run IMAGE` runs a replica; `docker run IMAGE status` (or check, timers list ...) any command.
ENTRYPOINT ["wowd"]
CMD ["run"]
