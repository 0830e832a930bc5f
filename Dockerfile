# The platform line: our overlay on the vendor's vLLM 0.6.3+corex (V0 engine, torch 2.1,
# Python 3.10), built FROM the platform's base image. The build fails unless the overlay deploys
# and verifies; it needs no network and no GPU (PLATFORM.md: the build host may have neither).
# The platform runs the command of computility-run.yaml inside this image.
#
#   BASE_IMAGE  the vendor's image (default); CI builds FROM the stand-in of it
#               (scripts/make_base_image.sh: the same Python, paths and package layout)
#   KERNELS_BUILD_TIMEOUT  seconds the CoreX clang build of our kernels may take (default 600);
#               0 skips it
#
# The 0.32.0 line's CPU image (a venv with pip installs from the network) is no longer built
# from this file: its steps need the network, this file's must not.
ARG BASE_IMAGE=harbor.4pd.io/modelhubxc/enginex-iluvatar/bi100-3.2.3-x86-ubuntu20.04-py3.10-poc-llm-infer:v1.2.3
FROM ${BASE_IMAGE}
ARG KERNELS_BUILD_TIMEOUT=600

# The CoreX environment the vendor's stack needs (PLATFORM.md): its torch and vLLM live in the
# corex dist-packages, its libraries (and OpenMPI's: without them `import ixformer` fails) on the
# library path. Whatever the base already sets stays, after ours. PIP_NO_INDEX: no step reaches
# an index, so one that tried would fail here rather than hang on an unreachable network.
ENV PATH=/usr/local/corex/bin:/usr/local/corex-3.2.3/bin:/usr/local/openmpi/bin:${PATH} \
    PYTHONPATH=/usr/local/corex/lib64/python3/dist-packages:/usr/local/corex/lib/python3/dist-packages${PYTHONPATH:+:${PYTHONPATH}} \
    LD_LIBRARY_PATH=/usr/local/corex/lib:/usr/local/corex/lib64:/usr/local/corex-3.2.3/lib:/usr/local/corex-3.2.3/lib64:/usr/local/openmpi/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}} \
    PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Our kernels (vo_native_kernels), in a layer of their own so that changing the Python overlay
# does not redo them: a prebuilt wheel from build-inputs/kernels/ if one is there, else a compile
# with the base's CoreX clang if it is there, bounded by KERNELS_BUILD_TIMEOUT, without ninja and
# with no GPU visible; anything else leaves the PyTorch ops serving (the server logs which).
# This step never fails the build; its outcome is in /workspace/kernels-build.txt.
# (scripts/image_kernels.py; the server may cite the report: VO_KERNELS_BUILD_REPORT.)
COPY scripts/image_kernels.py /workspace/scripts/image_kernels.py
COPY vllm_overrides/native/csrc/ /workspace/vllm_overrides/native/csrc/
RUN --mount=type=bind,source=build-inputs/kernels,target=/tmp/build-inputs/kernels \
    python3 /workspace/scripts/image_kernels.py /workspace/vllm_overrides/native/csrc \
      /tmp/build-inputs/kernels "${KERNELS_BUILD_TIMEOUT}" --report /workspace/kernels-build.txt
ENV VO_KERNELS_BUILD_REPORT=/workspace/kernels-build.txt

COPY patch_ops.sh computility-run.yaml chat_template_multi_system.jinja /workspace/
COPY patches/ /workspace/patches/
COPY vllm_overrides/ /workspace/vllm_overrides/
RUN PYTHON=python3 bash /workspace/patch_ops.sh apply && PYTHON=python3 bash /workspace/patch_ops.sh verify

WORKDIR /workspace
EXPOSE 8000
# The platform passes the YAML's command; this default serves /model the same way.
CMD ["python3", "-m", "vllm_overrides.launcher"]
