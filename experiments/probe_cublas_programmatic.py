"""Do cuBLAS's GEMMs wait for a programmatic predecessor? (No: cuBLAS 13.1's Hopper GEMMs do not.)

The compiled decode step's Triton kernels are programmatic dependent launches; cuBLAS's GEMMs are
not, so in the captured graph each GEMM starts only after the kernel before it has finished, about
1.2 us later. Turning the graph's edges into the GEMMs programmatic would remove that, but is only
safe if the GEMM waits (``griddepcontrol.wait``) before reading its input. This probe edits a
captured graph's edges through the CUDA driver API (ctypes) and checks:

- **race**: a one-program producer lets its dependents launch at once, then writes the consumer's
  input ``--spin-us`` later; a consumer that waits reads what it wrote in every replay, one that
  does not reads the old input. Consumers: cuBLAS GEMMs at decode shapes, a Triton copy that waits
  (``gdc_wait``) and one that does not. A producer of many programs (``wide``) occupies the SMs the
  GEMM needs, so the GEMM cannot start early and the check cannot fail: a false pass;
- **chain**: a decode-like chain of (Triton kernel, 64-row GEMM) pairs at Qwen2.5-1.5B's projection
  shapes, timed with plain and with programmatic edges into the GEMMs: what the edge would be worth
  for a GEMM that waited. The programmatic timing is not a safe configuration with cuBLAS.

With ``--quack`` (``quack-kernels`` installed) QuACK's CuTe-DSL Hopper GEMM, which launches as a
programmatic dependent launch and waits for its predecessor, is asked the same: its race check
(its edges are programmatic as captured, none edited) and its chain.

One CSV (``benchmarks/results/cublas_programmatic_<gpu>.csv``). The same question asked of the
machine code: ``--decode-gemms`` runs cuBLAS's GEMMs at Qwen2.5's decode shapes for Nsight Compute to
disassemble, and ``--sass DUMP`` counts, per kernel of its source page, the SASS of
``griddepcontrol.wait`` (``ACQBULK``) and of ``griddepcontrol.launch_dependents`` (``PREEXIT``)
into ``benchmarks/results/cublas_sass_waits_<gpu>.csv``.

Example (H200):
    PYTHONPATH=components python experiments/probe_cublas_programmatic.py
    ncu -k regex:"nvjet|delayed_copy" -c 80 --section SourceCounters --page source --print-source sass \
        python experiments/probe_cublas_programmatic.py --decode-gemms > sass.txt
    PYTHONPATH=components python experiments/probe_cublas_programmatic.py --sass sass.txt
"""

import argparse
import ctypes
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_generation import _table, save_rows  # noqa: E402
from bench_decode_linear import quack_linear  # noqa: E402

FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "cublaslt", "check", "producer", "consumer", "shape",
          "edges", "replays", "stale_replays", "graph_us", "per_gemm_us"]
TABLE = ["check", "producer", "consumer", "shape", "edges", "replays", "stale_replays", "graph_us", "per_gemm_us"]
BLOCK = 1024
# (rows, k, n) of decode GEMMs: Qwen2.5-1.5B's output, gate/up and down at 64 rows, 0.5B's output at 8
SHAPES = [(64, 1536, 1536), (64, 1536, 17920), (64, 8960, 1536), (8, 896, 896)]
# Qwen2.5 0.5B, 1.5B, 7B: hidden, fused q/k/v width, fused gate/up width, intermediate, vocabulary
DECODE_MODELS = {"0.5b": (896, 1152, 9728, 4864, 151936), "1.5b": (1536, 2048, 17920, 8960, 151936),
                 "7b": (3584, 4608, 37888, 18944, 152064)}
SASS_FIELDS = ["date", "gpu", "torch", "cublaslt", "kernel", "sass_instructions", "griddepcontrol_wait",
               "launch_dependents"]


class _EdgeData(ctypes.Structure):
    """``CUgraphEdgeData``."""
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2``."""
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _check(result, call):
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result}")


def _kernel_name(lib, node):
    """The kernel name of a graph node, None for other nodes."""
    kind = ctypes.c_int()
    _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
        return None
    params = _KernelParams()
    _check(lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.kern:  # a kernel loaded through a CUlibrary (cuBLAS's)
        _check(lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    else:
        _check(lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    return name.value.decode()


def _graph_edges(graph):
    """``(libcuda, graph handle, sources, destinations, edge data)`` of a captured ``graph``'s edges."""
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetEdges_v2(handle, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    _check(lib.cuGraphGetEdges_v2(handle, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges")
    return lib, handle, src, dst, data


def make_edges_programmatic(graph, consumer) -> int:
    """Turns the default kernel-to-kernel edges of a captured, not yet instantiated ``graph`` whose
    consumer's name satisfies ``consumer`` into programmatic ones (what stream capture records for a
    programmatic launch); returns how many."""
    lib, handle, src, dst, data = _graph_edges(graph)
    n = len(data)
    chosen = [i for i in range(n) if data[i].type == 0 and _kernel_name(lib, src[i]) is not None
              and consumer(_kernel_name(lib, dst[i]) or "")]
    for i in chosen:
        one = lambda v: (ctypes.c_void_p * 1)(v)  # noqa: E731
        _check(lib.cuGraphRemoveDependencies_v2(handle, one(src[i]), one(dst[i]), (_EdgeData * 1)(data[i]), 1),
               "cuGraphRemoveDependencies")
        # from the programmatic port, programmatic type
        _check(lib.cuGraphAddDependencies_v2(handle, one(src[i]), one(dst[i]), (_EdgeData * 1)(_EdgeData(1, 0, 1)), 1),
               "cuGraphAddDependencies")
    return len(chosen)


def programmatic_edges(graph) -> int:
    """How many edges of a captured ``graph`` are programmatic (as a programmatic launch records them)."""
    return sum(edge.type == 1 for edge in _graph_edges(graph)[4])


def cublaslt_version():
    """The loaded cuBLASLt's ``cublasLtGetVersion()`` (major * 10000 + minor * 100 + patch)."""
    torch.cuda.current_blas_handle()
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "libcublasLt.so" in line)
    lib = ctypes.CDLL(path)
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return int(lib.cublasLtGetVersion())


@triton.jit
def delayed_copy_kernel(src, dst, n, SPIN_NS: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    """Waits for its predecessor, lets its dependents launch at once, then copies ``src`` to ``dst``
    after ``SPIN_NS`` nanoseconds: every program one block (``LOOP`` False), or one program all of
    them (``LOOP``)."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    if SPIN_NS > 0:
        start = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - start < SPIN_NS:
            pass
    if LOOP:
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def copy_kernel(src, dst, n, WAIT: tl.constexpr, BLOCK: tl.constexpr):
    """Copies ``src`` to ``dst``, after ``gdc_wait`` with ``WAIT``: the control consumers."""
    if WAIT:
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def delayed_copy(src, dst, spin_us, one_program):
    n = src.numel()
    delayed_copy_kernel[(1 if one_program else triton.cdiv(n, BLOCK),)](
        src, dst, n, SPIN_NS=int(spin_us * 1000), BLOCK=BLOCK, LOOP=one_program, launch_pdl=True)


def captured(fn, programmatic_into=None):
    """``(graph, edges)``: ``fn`` run once (compiles, picks cuBLAS's kernels), then captured, with the
    edges into the kernels ``programmatic_into`` names made programmatic (``edges``: how many); without
    ``programmatic_into``, ``edges`` counts the programmatic edges as captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream):
        fn()
    edges = make_edges_programmatic(graph, programmatic_into) if programmatic_into else programmatic_edges(graph)
    graph.instantiate()
    return graph, edges


def stale_replays(consumer, shape, producer="one", replays=30, spin_us=20.0):
    """The race check: ``(edges, replays whose output missed the producer's write)``.
    ``consumer``: ``"cublas"`` (``x @ w``), ``"quack"`` (the same product by QuACK's GEMM, its edges as
    captured), ``"copy_wait"`` or ``"copy_no_wait"``; ``producer``: ``"one"`` program or ``"wide"``
    (one per 1024 elements)."""
    rows, k, n = shape
    src = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(src)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    gemm = consumer in ("cublas", "quack")
    out = torch.empty(rows, n if gemm else k, device="cuda", dtype=torch.bfloat16)
    product = (lambda a, out=None: torch.mm(a, w, out=out)) if consumer == "cublas" else (
        lambda a, out=None: quack_linear(a, w.t(), out=out))

    def fn():
        delayed_copy(src, x, spin_us, producer == "one")
        if gemm:
            product(x, out=out)
        else:
            copy_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), WAIT=consumer == "copy_wait", BLOCK=BLOCK)

    into = {"cublas": lambda name: name.startswith("nvjet"), "quack": None}.get(
        consumer, lambda name: name == "copy_kernel")
    graph, edges = captured(fn, into)
    stale = 0
    for _ in range(replays):
        src.copy_(torch.randn_like(src))
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        # a GEMM against its own product of the fresh input: the same kernel, the same bits
        stale += int(not torch.equal(out, product(src) if gemm else src))
    return edges, stale


def chain_rows(rows: int, hidden: int, layers: int, rounds: int, replays: int, gemm: str = "cublas"):
    """Times the decode-like chain with plain and programmatic edges into its GEMMs; counts the
    GEMMs of the last layer whose output differs from a fresh product after the timed replays.
    ``gemm="quack"``: QuACK's GEMMs, timed once, with the edges as captured (programmatic)."""
    widths = (2048, hidden, 17920, hidden)  # Qwen2.5-1.5B: q/k/v, output, gate/up, down (its input 8960)
    inputs = {hidden: torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
              8960: torch.randn(rows, 8960, device="cuda", dtype=torch.bfloat16)}
    staged = {k: torch.empty_like(v) for k, v in inputs.items()}
    gemms = []
    for _ in range(layers):
        for i, width in enumerate(widths):
            k = 8960 if i == 3 else hidden
            gemms.append((k, torch.randn(k, width, device="cuda", dtype=torch.bfloat16) / k ** 0.5,
                          torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)))

    product = (lambda a, w, out=None: torch.mm(a, w, out=out)) if gemm == "cublas" else (
        lambda a, w, out=None: quack_linear(a, w.t(), out=out))

    def fn():
        for k, w, out in gemms:
            delayed_copy(inputs[k], staged[k], 0.0, one_program=False)
            product(staged[k], w, out=out)

    variants = (False, True) if gemm == "cublas" else (None,)
    times, edges, stale = {p: [] for p in variants}, {}, {p: 0 for p in variants}
    for _ in range(rounds):
        for programmatic in variants:
            graph, edges[programmatic] = captured(fn, (lambda name: name.startswith("nvjet")) if programmatic else None)
            for _ in range(10):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[programmatic].append(start.elapsed_time(end) * 1000 / replays)
            stale[programmatic] += sum(not torch.equal(out, product(staged[k], w)) for k, w, out in gemms[-4:])
            del graph
    return [dict(check="chain", producer="wide", consumer=gemm, shape=f"{layers}x4 gemms, {rows} rows",
                 edges=edges[p], replays=replays * rounds, stale_replays=stale[p],
                 graph_us=f"{statistics.median(times[p]):.1f}", per_gemm_us=f"{statistics.median(times[p]) / len(gemms):.3f}")
            for p in variants]


def decode_gemms() -> None:
    """Runs ``F.linear`` (bf16) for every projection and the head of Qwen2.5 0.5B, 1.5B and 7B at 64,
    32, 16 and 8 rows (the cuBLAS kernels a decode step picks), and once the delayed copy, whose SASS
    holds both instructions (the control)."""
    src = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    delayed_copy(src, torch.empty_like(src), 0.0, one_program=True)
    for hidden, qkv, gate_up, inter, vocab in DECODE_MODELS.values():
        for rows in (64, 32, 16, 8):
            for k, n in ((hidden, qkv), (hidden, hidden), (hidden, gate_up), (inter, hidden), (hidden, vocab)):
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                torch.nn.functional.linear(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()


def sass_rows(dump: str):
    """Per kernel of an Nsight Compute source-page dump (``--print-source sass``): its SASS
    instructions and how many are ``ACQBULK`` (griddepcontrol.wait) and ``PREEXIT``
    (launch_dependents); a kernel profiled several times counts once."""
    rows, kernel = {}, None
    with open(dump) as fh:
        for line in fh:
            if line.startswith("Kernel Name"):
                kernel = line.split()[2]
                fresh = kernel not in rows
                if fresh:
                    rows[kernel] = dict(kernel=kernel, sass_instructions=0, griddepcontrol_wait=0, launch_dependents=0)
            elif kernel and fresh and line.startswith("0x"):
                row = rows[kernel]
                row["sass_instructions"] += 1
                row["griddepcontrol_wait"] += " ACQBULK" in line
                row["launch_dependents"] += " PREEXIT" in line
    return sorted(rows.values(), key=lambda r: r["kernel"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--spin-us", type=float, default=20.0)
    ap.add_argument("--layers", type=int, default=28, help="decode layers of the chain (4 GEMMs each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quack", action="store_true", help="also QuACK's GEMM (needs quack-kernels)")
    ap.add_argument("--decode-gemms", action="store_true", help="only run the decode GEMMs (under ncu)")
    ap.add_argument("--sass", default=None, help="summarise this ncu source-page dump instead")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    if args.decode_gemms:
        decode_gemms()
        return 0
    if args.sass:
        rows = sass_rows(args.sass)
        save_rows("cublas_sass_waits", SASS_FIELDS, rows, device, args.out, folder=RESULTS, cublaslt=cublaslt_version())
        print(_table(rows, SASS_FIELDS[4:]))
        return 0
    rows = []
    checks = [("one", "cublas", shape) for shape in SHAPES] + [("wide", "cublas", SHAPES[0])]
    checks += [("one", consumer, SHAPES[0]) for consumer in ("copy_wait", "copy_no_wait")]
    if args.quack:
        checks += [("one", "quack", shape) for shape in SHAPES]
    for producer, consumer, shape in checks:
        edges, stale = stale_replays(consumer, shape, producer, args.replays, args.spin_us)
        rows.append(dict(check="race", producer=producer, consumer=consumer, shape="x".join(map(str, shape)),
                         edges=edges, replays=args.replays, stale_replays=stale))
        print(_table([rows[-1]], TABLE).splitlines()[-1], flush=True)
    rows += chain_rows(64, 1536, args.layers, args.rounds, args.replays)
    if args.quack:
        rows += chain_rows(64, 1536, args.layers, args.rounds, args.replays, gemm="quack")
    save_rows("cublas_programmatic", FIELDS, rows, device, args.out, folder=RESULTS, cublaslt=cublaslt_version())
    print(_table(rows, TABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
