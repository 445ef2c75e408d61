"""Every cuBLASLt algorithm for Qwen2.5-VL-7B's four block GEMMs at few rows, not only the one torch takes.

torch's `F.linear` (bias in cuBLASLt's epilogue) asks cuBLASLt's heuristic for one algorithm and runs it. At 256
rows (one 224² image) those kernels leave most SMs idle (docs/journal/benchmarks.md: their tiling, not HBM, bounds
them), and torch offers no way to pick another: TunableOp searches only on ROCm. This script calls cuBLASLt itself
(ctypes, the library torch already loaded), asks the heuristic for up to `--algos` candidates, adds split-K
variants of the first few (`CUBLASLT_ALGO_CONFIG_SPLITK_NUM`, each checked with `cublasLtMatmulAlgoCheck`),
checks each candidate's output against `F.linear`'s, and times each: 20 calls per CUDA graph, µs per call.
Then a block's four GEMMs in sequence, torch's vs the fastest candidates, µs per block.

`python -m benchmarks.experiments.cublaslt_algos --rows 256,1024`

Answer (H200, 2026-12-03): every cuBLASLt candidate is the same kernel family; torch's heuristic pick is within
0–10% of each shape's fastest, the fastest four in sequence are 5% slower than torch's, and split-K loses
everywhere: no cuBLASLt algorithm shortens the one-image GEMMs.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import per_call_us

SHAPES = {"qkv": (1280, 3840), "proj": (1280, 1280), "gate_up": (1280, 6912), "down": (3456, 1280)}

# cublasLt.h (CUDA 12/13)
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
OP_N, OP_T, EPILOGUE_BIAS = 0, 1, 4
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_REDUCTION_SCHEME, CONFIG_STAGES_ID = 0, 1, 2, 3, 6
REDUCTIONS = {"inplace": 1, "compute": 2, "output": 4}
WORKSPACE = 32 * 2**20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch uses (loaded by a first matmul)."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(a, a, a[0])
    torch.cuda.synchronize()
    with open("/proc/self/maps") as fh:
        paths = {line.split()[-1] for line in fh if "libcublasLt" in line}
    assert paths, "libcublasLt is not loaded"
    return ctypes.CDLL(sorted(paths)[0])


class Lt:
    def __init__(self):
        self.lib = load_cublaslt()
        self.handle = ctypes.c_void_p()
        self.ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    @staticmethod
    def ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cublasLt {what}: status {status}")

    def set_attr(self, fn, obj, attr: int, value) -> None:
        self.ok(fn(obj, attr, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))), f"attribute {attr}")

    def problem(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor):
        """Descriptors of out = x @ w.T + bias, column-major: D [N, M] = op_T(W as [K, N]) @ x as [K, M]."""
        (m, k), n = x.shape, w.shape[0]
        lib = self.lib
        desc = ctypes.c_void_p()
        self.ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "desc")
        self.set_attr(lib.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        self.set_attr(lib.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        self.set_attr(lib.cublasLtMatmulDescSetAttribute, desc, DESC_EPILOGUE, ctypes.c_int32(EPILOGUE_BIAS))
        self.set_attr(lib.cublasLtMatmulDescSetAttribute, desc, DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        layouts = []
        for rows, cols in ((k, n), (k, m), (n, m), (n, m)):  # A, B, C, D
            lay = ctypes.c_void_p()
            self.ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, ctypes.c_uint64(rows),
                                                   ctypes.c_uint64(cols), ctypes.c_int64(rows)), "layout")  # fmt: skip
            layouts.append(lay)
        return desc, layouts

    def heuristics(self, desc, layouts, count: int) -> list[Heuristic]:
        pref = ctypes.c_void_p()
        self.ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        self.set_attr(self.lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES,
                      ctypes.c_uint64(WORKSPACE))  # fmt: skip
        results = (Heuristic * count)()
        found = ctypes.c_int()
        self.ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, *layouts, pref, count, results,
                                                        ctypes.byref(found)), "heuristic")  # fmt: skip
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def config(self, algo: Algo, attr: int) -> int:
        value, written = ctypes.c_uint32(), ctypes.c_size_t()
        size = ctypes.c_size_t(ctypes.sizeof(value))
        self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), size,
                                                      ctypes.byref(written))  # fmt: skip
        return value.value

    def split_k(self, desc, layouts, base: Algo, splits: int, reduction: int) -> Algo | None:
        algo = Algo()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
        for attr, value in ((CONFIG_SPLITK_NUM, splits), (CONFIG_REDUCTION_SCHEME, reduction)):
            v = ctypes.c_uint32(value)
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                             ctypes.c_size_t(ctypes.sizeof(v))) != 0:  # fmt: skip
                return None
        result = Heuristic()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, *layouts, ctypes.byref(algo), ctypes.byref(result))
        return algo if status == 0 and result.workspaceSize <= WORKSPACE else None

    def matmul(self, desc, layouts, algo: Algo, x, w, out) -> None:
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a, b, c, d = layouts
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.ok(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), a, ctypes.c_void_p(x.data_ptr()), b,
            ctypes.byref(zero), ctypes.c_void_p(out.data_ptr()), c, ctypes.c_void_p(out.data_ptr()), d,
            ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE), stream,
        ), "matmul")  # fmt: skip


def candidates(lt: Lt, desc, layouts, count: int, split_of: int) -> list[tuple[str, Algo]]:
    found = lt.heuristics(desc, layouts, count)
    out = []
    for i, h in enumerate(found):
        tag = (f"h{i} id{lt.config(h.algo, CONFIG_ID)} tile{lt.config(h.algo, CONFIG_TILE_ID)} "
               f"st{lt.config(h.algo, CONFIG_STAGES_ID)} sk{lt.config(h.algo, CONFIG_SPLITK_NUM)}")  # fmt: skip
        out.append((tag, h.algo))
        if i < split_of:
            for splits in (2, 3, 4, 6, 8):
                for name, scheme in REDUCTIONS.items():
                    algo = lt.split_k(desc, layouts, h.algo, splits, scheme)
                    if algo is not None:
                        out.append((f"h{i}+sk{splits}/{name}", algo))
    return out


def shape_row(lt: Lt, rows: int, name: str, k: int, n: int, args) -> tuple:
    """Time F.linear and every valid candidate at one shape; the calls of torch's and of the fastest."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, w, bias)
    scale = ref.abs().max().item()
    base = per_call_us(lambda: F.linear(x, w, bias))
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    desc, layouts = lt.problem(x, w, bias)
    timed = []
    for tag, algo in candidates(lt, desc, layouts, args.algos, args.split_of):
        out.fill_(float("nan"))  # poisoned: an output the kernel leaves unwritten shows
        try:
            lt.matmul(desc, layouts, algo, x, w, out)
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"  rows {rows} {name} {tag}: {e}", flush=True)
            continue
        err = ((out.float() - ref.float()).abs().max() / scale).item()
        if not err <= 2e-2:  # NaN too
            print(f"  rows {rows} {name} {tag}: wrong (rel err {err:.2e})", flush=True)
            continue
        us = per_call_us(lambda a=algo: lt.matmul(desc, layouts, a, x, w, out))
        timed.append((us, tag, algo, err))
    timed.sort(key=lambda t: t[0])
    first = next((t[0] for t in timed if t[1].startswith("h0 ")), float("nan"))
    best = "; ".join(f"{us:.2f} ({tag}, err {err:.1e})" for us, tag, _, err in timed[:5])
    print(f"rows {rows} {name} ({k}->{n}): F.linear {base:.2f} µs; {len(timed)} valid candidates; "
          f"heuristic #0 {first:.2f} µs; fastest {best}", flush=True)  # fmt: skip
    algo = timed[0][2]
    return (lambda: F.linear(x, w, bias)), (lambda: lt.matmul(desc, layouts, algo, x, w, out))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="256,1024")
    p.add_argument("--algos", type=int, default=64, help="heuristic candidates asked for")
    p.add_argument("--split-of", type=int, default=4, help="split-K variants of the first N heuristic picks")
    args = p.parse_args()
    torch.manual_seed(0)
    lt = Lt()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for rows in map(int, args.rows.split(",")):
        pairs = [shape_row(lt, rows, name, k, n, args) for name, (k, n) in SHAPES.items()]
        block_torch = per_call_us(lambda pairs=pairs: [t() for t, _ in pairs])
        block_best = per_call_us(lambda pairs=pairs: [b() for _, b in pairs])
        print(f"rows {rows}: a block's four GEMMs in one graph, torch {block_torch:.2f} µs, fastest cuBLASLt "
              f"picks {block_best:.2f} µs ({block_torch / block_best:.3f}x); over 32 blocks "
              f"{32 * (block_torch - block_best):.0f} µs a replay", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
