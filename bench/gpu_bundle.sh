#!/bin/bash
# Run bench/gpu_check.py on a GPU machine that has Python but no TVM and no package index.
#
#   bash bench/gpu_bundle.sh pack [CHECK]   here, from the repository root, with .venv built:
#       .gpu/tvm.tar.xz   TVM's Python package and runtime libraries, without its compiler
#                         (libtvm_compiler is 259 MB; the runtime is what the check needs)
#       .gpu/whl/         the CPython 3.12 wheel of tvm-ffi and platformdirs
#       .gpu/CHECK.tar.xz the folder `bench/gpu_check.py prepare .gpu/CHECK` made (default
#                         `check`)
#   bash bench/gpu_bundle.sh run [CHECK]    there, from a copy of the repository holding .gpu:
#       unpacks a runtime-only TVM for that machine's python3 and runs the check with it
#       (JOBS, ONLY, CHECK_TIMEOUT and OUT from the environment; the log and JSON go to $OUT)
#   bash bench/gpu_bundle.sh amx [CHECK]    the same for `bench/amx_check.py` (prefill on Intel
#       AMX: the CPU of an AMX machine), at 2 threads and at all of them (AMX_THREADS)
#
# .gpu/ is ignored by git: it is what a run carries, about 25 MB with the 1B-shape speed models'
# libraries (their weights are written there at random).
set -u
what=${1:?pack or run}
check=${2:-check}
case "$what" in
pack)
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p .gpu/whl
    tar -C "$site" --exclude=tvm/lib/libtvm_compiler.so --exclude=__pycache__ \
        --exclude=tvm/3rdparty --exclude=tvm/src -cJf .gpu/tvm.tar.xz tvm
    ffi=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("apache-tvm-ffi"))')
    dirs=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("platformdirs"))')
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d .gpu/whl "apache-tvm-ffi==$ffi" "platformdirs==$dirs"
    tar -C .gpu -cf - "$check" | xz -T0 -6 > ".gpu/$check.tar.xz"
    du -sh .gpu/tvm.tar.xz .gpu/whl ".gpu/$check.tar.xz"
    ;;
run|amx)
    mkdir -p /tmp/site /tmp/pkg /tmp/chk /tmp/home "${OUT:=/tmp/out}"
    tar -C /tmp/site -xJf .gpu/tvm.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    ln -sfn "$PWD/app" /tmp/pkg/localchat
    tar -C /tmp/chk -xJf ".gpu/$check.tar.xz"
    export PYTHONPATH=/tmp/site:/tmp/pkg TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1 HOME=/tmp/home
    # TVM's CUDA runtime needs libcudart; the CUDA source in the libraries needs NVRTC or nvcc
    export PATH=/usr/local/cuda/bin:$PATH
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    if [ "$what" = amx ]; then
        lscpu | grep "Model name"
        status=0
        for threads in ${AMX_THREADS:-2 $(nproc)}; do
            LOCALCHAT_NUM_THREADS=$threads timeout "${CHECK_TIMEOUT:-300}" \
                python3 bench/amx_check.py run "/tmp/chk/$check" 2>&1 | tee -a "$OUT/amx_check.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
        exit $status
    fi
    nvidia-smi -L
    timeout "${CHECK_TIMEOUT:-420}" python3 bench/gpu_check.py run "/tmp/chk/$check" \
        ${ONLY:+--only $ONLY} --jobs "${JOBS:-1}" --json "$OUT/gpu_check.json" 2>&1 |
        tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
    ;;
*)
    echo "usage: bash bench/gpu_bundle.sh pack|run|amx [CHECK]" >&2
    exit 2
    ;;
esac
