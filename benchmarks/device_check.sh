#!/usr/bin/env bash
# The device check (issue 39): one command, under 8 minutes on one CUDA GPU, that runs what
# this project has written for CUDA, NCCL and JAX devices and never runs on the CPU machines:
#
#   1. installs what it needs from the project's own files (pyproject's extras), unless
#      everything already imports;
#   2. the CUDA- and NCCL-marked tests of the suite:
#        tests/test_array_api.py      torch CUDA tensors through the numpy interpreter
#        tests/test_torch_distributed.py::test_nccl_device_path
#                                     one process with NCCL: every check of
#                                     tests/torchdist/checks.py on CUDA tensors (the executor's
#                                     device path)
#        tests/mpi/test_frameworks.py -k cuda
#                                     CUDA tensors through apply_mpi (1 and 2 ranks)
#   3. CUDA tensors through the layer modules: LayerModule(Convolution) on one NCCL process,
#      forward and backward, parameters on their owner and replicated, against torch's Conv2d
#      on the same device (float64);
#   4. JAX on the GPU: tests/jax_devices/check_lowering.py on the one GPU (the lowering equal
#      to the numpy interpreter, its transposes to op.H, exactly), and a sharded halo windows'
#      gradient against the numpy interpreter;
#   5. small GPU benchmarks (medians, one process): the 2x8x64x64 convolution training step of
#      LayerModule against torch's own conv2d step, and sharded halo windows on JAX against
#      jnp.pad, both on the GPU;
#   6. writes a short report: $OUT/device_report.txt when $OUT is set, else ./device_report.txt.
#
# Usage (from the repository root):
#   bash benchmarks/device_check.sh              # on a machine with a CUDA GPU
#   bash benchmarks/device_check.sh --dry-run    # anywhere: no install, no GPU needed; steps
#                                                # 3-5 on the CPU (gloo, JAX on the CPU) at
#                                                # small sizes, step 2's tests collected only
#   bash benchmarks/device_check.sh --no-install # use the environment as it is
#
# Installing: `pip install -e '.[dev,torch,jax]'` (pyproject.toml). A CUDA torch already
# installed is kept (the `torch` extra asks only torch>=2.1); where torch is missing, pip's
# default torch wheel for Linux x86_64 is the CUDA build. JAX's default wheel runs on the CPU
# only: its CUDA build is `jax[cuda12]` (CUDA 12 wheels from PyPI, NVIDIA driver >= 525; set
# LINOP_JAX_CUDA=cuda13 for `jax[cuda13]`, or LINOP_JAX_CUDA=none to keep JAX as it is).
# Without network access the install is skipped with a note (each pip call is bounded), and
# the steps whose packages are missing are reported as skipped. The repository root is put
# on PYTHONPATH, so an install is not needed for linop itself.
#
# Without a GPU (no `nvidia-smi -L` device and torch.cuda.is_available() false) a run that is
# not --dry-run writes the report saying so and exits 2. Otherwise the exit status is 0 when
# every step that ran passed, 1 when one failed. Every step is bounded by `timeout`, and the
# whole run by LINOP_DEVICE_BUDGET seconds (default 450).

set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DRY=0
INSTALL=1
for argument in "$@"; do
    case "$argument" in
        --dry-run) DRY=1; INSTALL=0 ;;
        --no-install) INSTALL=0 ;;
        -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
        *) echo "device_check.sh: unknown argument $argument (see --help)" >&2; exit 64 ;;
    esac
done
PYTHON=${PYTHON:-python}
command -v "$PYTHON" > /dev/null 2>&1 || PYTHON=python3
REPORT_DIR=${OUT:-$ROOT}
REPORT=$REPORT_DIR/device_report.txt
if [ -n "${OUT:-}" ]; then LOGS=$OUT/device_logs; else LOGS=$(mktemp -d /tmp/linop-device-XXXXXX); fi
mkdir -p "$LOGS" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# torch and JAX share the GPU in the benchmarks' process: JAX takes memory as it needs it
# instead of 75% of the device at its start
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
BUDGET=${LINOP_DEVICE_BUDGET:-450}
START=$(date +%s)
FAILED=0
: > "$REPORT"

note() { echo "$*" | tee -a "$REPORT"; }

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT COMMAND...: run COMMAND under min(LIMIT, what is left of the budget); its
# output goes to $LOGS/NAME.log, its last lines and its outcome to the report.
step() {
    local name=$1 limit=$2
    shift 2
    local remaining
    remaining=$(left)
    if (( remaining < 10 )); then
        note "[skipped] $name: the budget of ${BUDGET} s is spent"
        return
    fi
    (( limit > remaining )) && limit=$remaining
    local began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local status=$?
    local took=$(( $(date +%s) - began ))
    if (( status == 0 )); then
        note "[passed] $name (${took} s)"
    elif (( status == 124 || status == 137 )); then
        note "[FAILED] $name: timed out after ${limit} s"
        FAILED=1
    elif (( status == 5 )); then  # pytest: nothing collected (every test deselected)
        note "[skipped] $name: no test selected (${took} s)"
    else
        note "[FAILED] $name: exit status $status (${took} s)"
        FAILED=1
    fi
    grep -E "^(RESULT|SKIP|CHECKS OK|OK |FAILED)|[0-9]+ (passed|failed|skipped|errors?|deselected|tests? collected)" "$LOGS/$name.log" \
        | tail -n 12 | sed 's/^/    /' | tee -a "$REPORT"
    if (( status != 0 )); then
        tail -n 15 "$LOGS/$name.log" | sed 's/^/    | /' >> "$REPORT"
    fi
}

note "linop device check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$( ((DRY)) && echo ' (dry run)')"
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > "$LOGS/nvidia-smi.log" 2>&1; then
    GPU=1
    note "GPU: $(head -n 1 "$LOGS/nvidia-smi.log")"
    nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>/dev/null \
        | sed 's/^/driver, memory: /' | tee -a "$REPORT"
else
    GPU=0
    note "GPU: none found (nvidia-smi missing or lists no device)"
fi

# -- 1. install ------------------------------------------------------------------------------
imports() { "$PYTHON" -c "import numpy, pytest, torch, jax, mpi4py, hypothesis" > /dev/null 2>&1; }
if (( INSTALL )); then
    export PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-20}
    JAX_CUDA=${LINOP_JAX_CUDA:-cuda12}
    WANTS_JAX_CUDA=0
    if (( GPU )) && [ "$JAX_CUDA" != none ] \
        && ! "$PYTHON" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" > /dev/null 2>&1; then
        WANTS_JAX_CUDA=1
    fi
    if imports && (( ! WANTS_JAX_CUDA )); then
        note "[install] everything imports: nothing installed"
    elif ! timeout 15 "$PYTHON" -c "import urllib.request as u; u.urlopen('https://pypi.org/simple/pip/', timeout=10)" \
        > /dev/null 2>&1; then
        note "[install] skipped: the package index cannot be reached; the steps run with what imports"
    else
        # an install that fails is noted, not a failure of the check: the steps then run with
        # what imports, and those whose packages are missing fail or skip on their own
        SAVED=$FAILED
        imports || step install 240 "$PYTHON" -m pip install --retries 1 -e ".[dev,torch,jax]"
        (( WANTS_JAX_CUDA )) && step install-jax-cuda 180 "$PYTHON" -m pip install --retries 1 "jax[$JAX_CUDA]"
        FAILED=$SAVED
    fi
fi
"$PYTHON" - > "$LOGS/versions.log" 2>&1 <<'PY'
import importlib
for name in ("numpy", "torch", "jax", "mpi4py", "pytest"):
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - reported, not raised
        print(f"{name}: missing ({type(error).__name__})")
        continue
    extra = ""
    if name == "torch":
        extra = f", CUDA {module.version.cuda}, available {module.cuda.is_available()}"
    if name == "jax":
        extra = f", backend {module.default_backend()}, devices {module.devices()}"
    print(f"{name} {getattr(module, '__version__', '?')}{extra}")
PY
sed 's/^/  /' "$LOGS/versions.log" | tee -a "$REPORT"
CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if (( GPU )) && (( ! CUDA )); then
    note "note: a GPU is present but torch cannot use it (a CPU torch, or no torch): the torch steps skip or fail"
fi
if (( ! DRY )) && (( ! GPU )) && (( ! CUDA )); then
    note "no CUDA device: nothing to check here (run with --dry-run to try the script on the CPU)"
    note "report: $REPORT"
    exit 2
fi

# -- the checks and benchmarks of steps 3-5, one Python file (device: cuda, or cpu when dry) --
CHECKS=$LOGS/device_checks.py
cat > "$CHECKS" <<'PY'
"""Steps 3-5 of benchmarks/device_check.sh: python device_checks.py PART [--cpu]."""

import datetime
import os
import socket
import statistics
import sys
import time

import numpy as np

PART = sys.argv[1]
CPU = "--cpu" in sys.argv


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_process_group():
    """A torch.distributed world of this one process: NCCL on the GPU (gloo with --cpu)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if CPU else torch.device("cuda", 0)
    if not CPU:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo" if CPU else "nccl",
        init_method=f"tcp://127.0.0.1:{port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    return torch, dist, device


def synchronize(torch) -> None:
    if not CPU:
        torch.cuda.synchronize()


def medians_ms(methods: dict, repeats: int, torch=None) -> dict:
    """Median milliseconds of one call of each method, the methods' samples interleaved (a
    load that comes and goes weighs on each alike); the device synchronized around each."""
    for run in methods.values():
        for _ in range(3):
            run()
    samples: dict = {name: [] for name in methods}
    for _ in range(repeats):
        for name, run in methods.items():
            if torch is not None:
                synchronize(torch)
            start = time.perf_counter()
            run()
            if torch is not None:
                synchronize(torch)
            samples[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in samples.items()}


def layer() -> None:
    """LayerModule(Convolution) with tensors on the device, owners and replicated, against
    torch's Conv2d: outputs, input and parameter gradients, two calls (the bound plans)."""
    torch, dist, device = one_process_group()
    from linop import DistributedTensor, Kernel, Partition
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    x = DistributedTensor("x", (2, 3, 9, 5), Partition((1, 1, 1, 1)))
    conv = Convolution(x, 2, Kernel(3, padding=1))
    rng = np.random.default_rng(3)
    weights = rng.standard_normal(conv.weights.global_shape)
    bias = rng.standard_normal(conv.bias.global_shape)
    problems = []
    for replicate in (False, True):
        module = LayerModule(conv, weights=weights, bias=bias, group=True, replicate=replicate).to(device)
        twin = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=torch.float64).to(device)
        with torch.no_grad():
            twin.weight.copy_(torch.from_numpy(weights))
            twin.bias.copy_(torch.from_numpy(bias))
        image = torch.from_numpy(rng.standard_normal(x.global_shape)).to(device).requires_grad_()
        for call in range(2):
            mine = {b.name: image.detach().clone().requires_grad_() for b in x.space}
            image.grad = None
            for p in (*module.parameters(), *twin.parameters()):
                p.grad = None
            out = module(mine)
            on_device = all(v.device.type == device.type for v in out.values())
            (sum((v * v).sum() for v in out.values()) + module.token.sum()).backward()
            expected = twin(image)
            (expected**2).sum().backward()
            name = f"replicate={replicate}, call {call + 1}"
            if not on_device:
                problems.append(f"{name}: outputs on {[str(v.device) for v in out.values()]}")
            got = next(iter(out.values()))
            if not torch.allclose(got, expected):
                problems.append(f"{name}: outputs differ from Conv2d's")
            grad = next(iter(mine.values())).grad
            if grad is None or not torch.allclose(grad, image.grad):
                problems.append(f"{name}: input gradients differ")
            # one worker: one weights and one bias block (or copy), each the whole parameter
            whole = {p.shape: p.grad.cpu().numpy() for p in twin.parameters()}
            grads = {n: p.grad for n, p in module.parameter_state().items()}
            wrong = [
                n for n, g in grads.items() if g is None or not np.allclose(g.cpu().numpy(), whole[g.shape])
            ]
            if wrong:
                problems.append(f"{name}: parameter gradients differ: {wrong}")
    dist.destroy_process_group()
    if problems:
        raise SystemExit("FAILED " + "; ".join(problems))
    print(f"RESULT LayerModule on {device.type}: outputs and gradients equal Conv2d's (owners, replicated)")


def jax_halo() -> None:
    """Sharded halo windows on the one device (the GPU, or the CPU with --cpu): the output
    and the gradient of |W x|^2 (2 W^T W x) against the numpy interpreter, exactly."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from linop import DistributedTensor, Kernel, Partition, halo_windows
    from linop.frameworks.jax_sharded import sharded

    device = jax.devices()[0]
    if not CPU and device.platform != "gpu":
        raise SystemExit(f"FAILED JAX runs on {device.platform}, not on the GPU")
    u = DistributedTensor("u", (64, 48), Partition.grid((1, 1)))
    windows = halo_windows(u, Kernel(3, padding=1))
    w = sharded(windows, Mesh(np.array([device]), ("d",)))
    field = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    state = u.scatter(field)
    out = w.blocks(state)
    expected = windows(state)
    slots = w.pack(state)
    loss = lambda s: sum(jnp.sum(v * v) for v in w(s).values())  # noqa: E731
    gradient = w.unpack(jax.jit(jax.grad(loss))(slots), w.domain)
    twice = windows.H(expected)
    problems = [n for n in expected if not np.array_equal(np.asarray(out[n]), expected[n])]
    problems += [n for n in twice if not np.array_equal(np.asarray(gradient[n]), 2 * twice[n])]
    if problems:
        raise SystemExit(f"FAILED sharded halo windows on {device.platform}: {problems}")
    print(f"RESULT sharded halo windows on {device.platform}: output and gradient exact")


def bench() -> None:
    """Small benchmarks on the device: a 2x8x64x64 float32 convolution training step of
    LayerModule (one NCCL process, parameters on their owner) against torch's conv2d step, and
    sharded halo windows (jit) against jnp.pad."""
    torch, dist, device = one_process_group()
    from linop import DistributedTensor, Kernel, Partition
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    n = 16 if CPU else 64
    repeats = 9 if CPU else 50
    x = DistributedTensor("x", (2, 8, n, n), Partition((1, 1, 1, 1)))
    conv = Convolution(x, 8, Kernel(3, padding=1))
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(conv.weights.global_shape).astype(np.float32)
    bias = rng.standard_normal(conv.bias.global_shape).astype(np.float32)
    module = LayerModule(conv, weights=weights, bias=bias, group=True, dtype=torch.float32).to(device)
    image = torch.from_numpy(rng.standard_normal(x.global_shape).astype(np.float32)).to(device)
    mine = {b.name: image.clone().requires_grad_() for b in x.space}
    weight = torch.from_numpy(weights).to(device).requires_grad_()
    offset = torch.from_numpy(bias).to(device).requires_grad_()
    plain = image.clone().requires_grad_()

    def linop_step() -> None:
        out = module(mine)
        (sum((v * v).sum() for v in out.values()) + module.token.sum()).backward()

    def torch_step() -> None:
        (torch.nn.functional.conv2d(plain, weight, offset, padding=1) ** 2).sum().backward()

    if CPU:
        torch.set_num_threads(1)  # a shared CPU: one thread each, as the layer's processes would
    times = medians_ms({"linop": linop_step, "torch": torch_step}, repeats, torch)
    linop_ms, torch_ms = times["linop"], times["torch"]
    print(
        f"RESULT conv step 2x8x{n}x{n} float32 on {device.type}: LayerModule {linop_ms:.3f} ms, "
        f"torch conv2d {torch_ms:.3f} ms, ratio {linop_ms / torch_ms:.2f}x"
    )
    dist.destroy_process_group()

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from linop import halo_windows
    from linop.frameworks.jax_sharded import sharded

    side = 256 if CPU else 2048
    u = DistributedTensor("u", (side, side), Partition.grid((1, 1)))
    w = sharded(halo_windows(u, Kernel(3, padding=1)), Mesh(np.array(jax.devices()[:1]), ("d",)))
    slots = w.pack(u.scatter(np.ones((side, side), dtype=np.float32)))
    linop_call = jax.jit(w)
    padded = jax.jit(lambda a: jnp.pad(a, 1))
    field = jnp.ones((side, side), dtype=jnp.float32)
    times = medians_ms(
        {
            "linop": lambda: jax.block_until_ready(linop_call(slots)),
            "pad": lambda: jax.block_until_ready(padded(field)),
        },
        repeats,
    )
    linop_ms, pad_ms = times["linop"], times["pad"]
    print(
        f"RESULT halo windows {side}^2 float32 on {jax.devices()[0].platform} (jit): sharded "
        f"{linop_ms:.3f} ms, jnp.pad {pad_ms:.3f} ms, ratio {linop_ms / pad_ms:.2f}x"
    )


{"layer": layer, "jax": jax_halo, "bench": bench}[PART]()
PY

# -- 2. the CUDA- and NCCL-marked tests --------------------------------------------------------
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rs)
if (( DRY )); then  # collected only: the selection exists (run, they skip without a GPU)
    step tests-collected 120 "${PYTEST[@]}" --collect-only \
        tests/test_array_api.py::test_torch_cuda_tensors_come_back_on_their_device \
        tests/test_torch_distributed.py::test_nccl_device_path
else
    step cuda-tensors 120 "${PYTEST[@]}" tests/test_array_api.py -k cuda
    step nccl-one-process 240 "${PYTEST[@]}" tests/test_torch_distributed.py -k nccl
    if "$PYTHON" -c "import mpi4py" > /dev/null 2>&1; then
        MPIEXEC=$(dirname "$(command -v "$PYTHON")")/mpiexec
        [ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)
        step mpi-cuda-tensors 120 env LINOP_MPI_TESTS=1 "$MPIEXEC" -n 2 "$PYTHON" tests/mpi/run_passes.py 2 1 \
            -- -k cuda -q -p no:cacheprovider -rs
    else
        note "[skipped] mpi-cuda-tensors: mpi4py missing"
    fi
fi

# -- 3-5. layer modules, JAX on the device, benchmarks ----------------------------------------
DEVICE_FLAG=$( ((DRY)) && echo --cpu )
step layer-module 120 "$PYTHON" "$CHECKS" layer $DEVICE_FLAG
if (( ! DRY )); then
    step jax-lowering 180 "$PYTHON" tests/jax_devices/check_lowering.py 1 1
fi
step jax-halo 120 "$PYTHON" "$CHECKS" jax $DEVICE_FLAG
step benchmarks 150 "$PYTHON" "$CHECKS" bench $DEVICE_FLAG

note "total $(( $(date +%s) - START )) s; logs in $LOGS; report: $REPORT"
if (( FAILED )); then
    note "RESULT: a step FAILED"
    exit 1
fi
note "RESULT: every step that ran passed"
exit 0
