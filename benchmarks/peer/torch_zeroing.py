#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Block zeroing the way PyTorch engines do it, next to kvport's `kvport bench`.

The same KV-cache pools as kvport's zeroing bench (benchmarks/support: model
shapes llama-3-8b, llama-3-70b and llama-3-8b-mixed; layer_major and
block_major layouts; a cache of 2 x the largest batch) are allocated as torch
tensors, and the same batches of blocks are zeroed three ways:

  torch_per_layer  index_fill_(0, ids, 0) on every layer's K and V pool:
                   2 x layers tensor ops per batch (a PyTorch engine's way)
  triton           one Triton kernel over every pool through a table of
                   pool base pointers (vLLM's KVBlockZeroer's way); cuda only
  limit            one zero_() of a contiguous tensor of the same bytes

Every strategy is verified: the pools are filled with a nonzero pattern first,
and after the timed runs the zeroed blocks must be all zero bits and a sample
of the other blocks must still hold the pattern.

fp8 layers are stored as torch.uint8 (torch 1.13 has no float8 dtype; the
bytes are the same and zeroing does not look at the values). A mixed-dtype
block_major pool is one uint8 tensor [num_blocks, bytes_per_block].

Exit status: 0, 1 when a verification failed, 2 on bad input, 3 when torch or
the requested device is not available.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 3

PROG = "torch_zeroing.py"
MODELS = ("llama-3-8b", "llama-3-70b", "llama-3-8b-mixed")
LAYOUTS = ("layer_major", "block_major")
ID_PATTERNS = ("contiguous", "scattered")
DEFAULT_BATCHES = (1, 16, 256)
SMALL_BATCHES = (1, 4, 16)
MAX_BATCH = 1 << 20
MAX_REPETITIONS = 1000
# kvport pads every K / V block region to 16 bytes; the shapes here need no
# padding, which Shape checks, so that a block's bytes are exactly kvport's.
REGION_ALIGNMENT = 16
# Byte patterns the pools are filled with before each strategy: bf16 1.0
# (0x3f80) and 0x5a for byte pools. Both are nonzero in every element.
BF16_FILL = 1.0
BYTE_FILL = 0x5A
# Untouched blocks checked per case besides every zeroed neighbour.
SAMPLE_OTHERS = 32
# Bytes after the limit strategy's range that must keep their fill.
LIMIT_GUARD_BYTES = 4096


class BadInput(Exception):
    """A command-line value or an input file the run cannot use (exit 2)."""


class Unavailable(Exception):
    """torch, triton or the requested device is missing (exit 3)."""


@dataclass(frozen=True)
class Shape:
    """A model's KV-cache block shape, as in kvport::sim::zeroing_shapes()."""

    name: str
    layers: int
    block_size: int
    heads: int
    head_dim: int
    layer_dtypes: Tuple[str, ...]  # "bf16" or "fp8" per layer

    def __post_init__(self) -> None:
        if len(self.layer_dtypes) != self.layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_dtypes)} layer dtypes for {self.layers} layers"
            )
        for layer in range(self.layers):
            if self.region_bytes(layer) % REGION_ALIGNMENT:
                raise ValueError(
                    f"{self.name}: layer {layer} region is not a multiple of {REGION_ALIGNMENT} bytes"
                )

    @property
    def mixed(self) -> bool:
        """True when the layers do not all share one dtype."""
        return len(set(self.layer_dtypes)) > 1

    def element_bytes(self, layer: int) -> int:
        """Bytes per element of a layer: 2 for bf16, 1 for fp8."""
        return 2 if self.layer_dtypes[layer] == "bf16" else 1

    def region_bytes(self, layer: int) -> int:
        """Bytes of one block of one layer, for K (V is the same size)."""
        return self.block_size * self.heads * self.head_dim * self.element_bytes(layer)

    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, K + V (kvport's bytes_per_block)."""
        return sum(2 * self.region_bytes(layer) for layer in range(self.layers))


def make_shapes(small: bool) -> Dict[str, Shape]:
    """The bench's model shapes; `small` keeps their structure at a CPU-friendly size."""
    if small:
        layers = {"llama-3-8b": 4, "llama-3-70b": 10, "llama-3-8b-mixed": 4}
        heads, head_dim = 2, 16
    else:
        layers = {"llama-3-8b": 32, "llama-3-70b": 80, "llama-3-8b-mixed": 32}
        heads, head_dim = 8, 128
    shapes = {}
    for name, n in layers.items():
        dtypes = ["bf16"] * n
        if name.endswith("-mixed"):
            # bf16 first and last layers, fp8_e4m3 elsewhere.
            dtypes = ["bf16"] + ["fp8"] * (n - 2) + ["bf16"]
        shapes[name] = Shape(name, n, 16, heads, head_dim, tuple(dtypes))
    return shapes


@dataclass
class Case:
    """One measurement: a batch of block ids of one model and layout."""

    model: str
    layout: str
    batch: int
    ids_pattern: str
    block_ids: List[int]
    num_blocks: int


@dataclass
class StrategyResult:
    """One strategy's figures for one case."""

    seconds: float
    bytes_per_s: float
    launches: int
    verified: bool
    problems: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The JSON object of the --out file."""
        return {
            "seconds": self.seconds,
            "bytes_per_s": self.bytes_per_s,
            "launches": self.launches,
            "verified": self.verified,
        }


# --------------------------------------------------------------------------
# Input


def parse_list(text: str, allowed: Sequence[str], flag: str) -> List[str]:
    """A comma-separated selection from `allowed`, in the given order, no duplicates."""
    out: List[str] = []
    for item in text.split(","):
        item = item.strip().lower().replace("-major", "_major")
        if item not in allowed:
            raise BadInput(f"{flag}: unknown value '{item}' (known: {', '.join(allowed)})")
        if item not in out:
            out.append(item)
    return out


def parse_batches(text: str) -> List[int]:
    """A comma-separated list of positive block counts, sorted, duplicates dropped."""
    out = set()
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) == 0:
            raise BadInput(f"--batches: '{item}' is not a positive count")
        if int(item) > MAX_BATCH:
            raise BadInput(f"--batches: at most {MAX_BATCH} blocks, got {item}")
        out.add(int(item))
    return sorted(out)


def scattered_ids(batch: int, seed: int = 1) -> List[int]:
    """Every other block (no two ids adjacent) in a shuffled order.

    The same set as kvport's scattered ids; the order differs (kvport shuffles
    with std::mt19937), which --kvport-json avoids by taking kvport's ids.
    """
    ids = list(range(0, 2 * batch, 2))
    random.Random(seed).shuffle(ids)
    return ids


def plan_cases(models: Sequence[str], layouts: Sequence[str], batches: Sequence[int]) -> List[Case]:
    """Every model x layout x batch x id pattern, with a cache of 2 x the largest batch."""
    num_blocks = 2 * max(batches)
    cases = []
    for model in models:
        for layout in layouts:
            for batch in batches:
                cases.append(
                    Case(model, layout, batch, "contiguous", list(range(batch)), num_blocks)
                )
                cases.append(
                    Case(model, layout, batch, "scattered", scattered_ids(batch), num_blocks)
                )
    return cases


def _field(case: dict, name: str, kind: type, where: str):
    """A required field of a kvport case, of the given JSON type."""
    if name not in case:
        raise BadInput(
            f"{where}: no '{name}' field (a `kvport bench --json` output of this kvport has it)"
        )
    value = case[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadInput(f"{where}: '{name}' is not an integer")
    if not isinstance(value, kind):
        raise BadInput(f"{where}: '{name}' is not a {kind.__name__}")
    return value


def cases_from_kvport(path: str, shapes: Dict[str, Shape]) -> List[Case]:
    """The cases of a `kvport bench --json` output, with kvport's exact block ids.

    Checks what the peer relies on: known models and layouts, ids that are
    distinct and inside the cache, and kvport's byte count equal to the
    peer's for the same shape.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BadInput(f"--kvport-json: cannot read {path}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"--kvport-json: {path} is not JSON: {e}") from e
    if not isinstance(data, list) or not data:
        raise BadInput(
            f"--kvport-json: {path} is not a non-empty list of cases (kvport bench --json)"
        )
    cases = []
    for i, c in enumerate(data):
        where = f"--kvport-json: {path}: case {i}"
        if not isinstance(c, dict):
            raise BadInput(f"{where}: not an object")
        model = _field(c, "model", str, where)
        layout = _field(c, "layout", str, where)
        batch = _field(c, "batch", int, where)
        pattern = _field(c, "ids", str, where)
        if pattern not in ID_PATTERNS:
            raise BadInput(f"{where}: unknown ids pattern '{pattern}'")
        num_blocks = _field(c, "num_blocks", int, where)
        block_ids = _field(c, "block_ids", list, where)
        nbytes = _field(c, "bytes", int, where)
        if model not in shapes:
            raise BadInput(f"{where}: unknown model '{model}' (known: {', '.join(shapes)})")
        if layout not in LAYOUTS:
            raise BadInput(f"{where}: unknown layout '{layout}'")
        if batch <= 0 or len(block_ids) != batch:
            raise BadInput(f"{where}: {len(block_ids)} block ids for a batch of {batch}")
        if any(
            isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks
            for b in block_ids
        ):
            raise BadInput(f"{where}: block ids must be integers in [0, {num_blocks})")
        if len(set(block_ids)) != batch:
            raise BadInput(f"{where}: duplicate block ids")
        expected = batch * shapes[model].bytes_per_block()
        if nbytes != expected:
            raise BadInput(
                f"{where}: kvport zeroed {nbytes} bytes, the peer's {model} shape {expected}"
            )
        cases.append(Case(model, layout, batch, pattern, list(block_ids), num_blocks))
    return cases


# --------------------------------------------------------------------------
# Pools


class Pools:
    """A KV cache of one shape and layout as torch tensors, and a limit buffer.

    `views` holds, per layer, the K and V tensors with the block on dim 0:
    separate tensors in layer_major, views into the one pool in block_major.
    `regions` is the (tensor, block stride in bytes, block bytes) table the
    Triton kernel zeroes: every K and V pool in layer_major, the whole pool
    (one region per block) in block_major.
    """

    def __init__(self, torch, shape: Shape, layout: str, num_blocks: int, limit_bytes: int, device):
        self.torch = torch
        self.shape = shape
        self.layout = layout
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.block_size, shape.heads, shape.head_dim)
        self.views: List[Tuple[object, object]] = []
        self.regions: List[Tuple[object, int, int]] = []
        self.storage: List[object] = []
        if layout == "layer_major":
            for layer in range(shape.layers):
                dtype = self._dtype(shape.layer_dtypes[layer])
                k = torch.empty(dims, dtype=dtype, device=device)
                v = torch.empty(dims, dtype=dtype, device=device)
                self.views.append((k, v))
                self.storage += [k, v]
                for t in (k, v):
                    self.regions.append((t, shape.region_bytes(layer), shape.region_bytes(layer)))
        elif not shape.mixed:
            dtype = self._dtype(shape.layer_dtypes[0])
            pool = torch.empty((num_blocks, shape.layers, 2) + dims[1:], dtype=dtype, device=device)
            self.views = [(pool[:, layer, 0], pool[:, layer, 1]) for layer in range(shape.layers)]
            self.storage = [pool]
            self.regions = [(pool, shape.bytes_per_block(), shape.bytes_per_block())]
        else:
            pool = torch.empty(
                (num_blocks, shape.bytes_per_block()), dtype=torch.uint8, device=device
            )
            offset = 0
            for layer in range(shape.layers):
                size = shape.region_bytes(layer)
                self.views.append(
                    (pool[:, offset : offset + size], pool[:, offset + size : offset + 2 * size])
                )
                offset += 2 * size
            self.storage = [pool]
            self.regions = [(pool, shape.bytes_per_block(), shape.bytes_per_block())]
        self.limit = torch.empty(limit_bytes + LIMIT_GUARD_BYTES, dtype=torch.uint8, device=device)
        self.fill()

    def _dtype(self, name: str):
        return self.torch.bfloat16 if name == "bf16" else self.torch.uint8

    @staticmethod
    def _fill_value(t) -> float:
        return BF16_FILL if t.element_size() == 2 else BYTE_FILL

    def fill(self) -> None:
        """Every byte of the pools and the limit buffer to the nonzero pattern."""
        for t in self.storage:
            t.fill_(self._fill_value(t))
        self.limit.fill_(BYTE_FILL)

    def _bits(self, t):
        """An integer view with the same element size, so that -0.0 is not zero."""
        return t.view(self.torch.int16) if t.element_size() == 2 else t

    def check_blocks(self, block_ids: List[int]) -> List[str]:
        """Problems with the pools after `block_ids` were zeroed (empty when right)."""
        torch = self.torch
        zeroed = set(block_ids)
        device = self.storage[0].device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        others = self._sample_others(zeroed)
        others_t = torch.tensor(others, dtype=torch.long, device=device)
        problems = []
        for layer, pair in enumerate(self.views):
            for name, t in zip("KV", pair):
                if bool((self._bits(t.index_select(0, ids)) != 0).any()):
                    problems.append(f"layer {layer} {name}: a zeroed block holds nonzero bytes")
                if others and bool((t.index_select(0, others_t) != self._fill_value(t)).any()):
                    problems.append(
                        f"layer {layer} {name}: a block outside the batch lost its fill"
                    )
        return problems

    def _sample_others(self, zeroed: set) -> List[int]:
        """Blocks outside the batch to check: every neighbour of a zeroed block
        (the likeliest victims of an off-by-one), the first and last block,
        and a seeded sample of the rest."""
        rest = [b for b in range(self.num_blocks) if b not in zeroed]
        picked = {
            b
            for z in zeroed
            for b in (z - 1, z + 1)
            if 0 <= b < self.num_blocks and b not in zeroed
        }
        picked.update(b for b in (rest[:1] + rest[-1:]))
        remaining = [b for b in rest if b not in picked]
        picked.update(random.Random(7).sample(remaining, min(SAMPLE_OTHERS, len(remaining))))
        return sorted(picked)

    def check_limit(self, nbytes: int) -> List[str]:
        """Problems with the limit buffer after its first `nbytes` were zeroed."""
        problems = []
        if bool((self.limit[:nbytes] != 0).any()):
            problems.append(f"limit: nonzero bytes in the first {nbytes}")
        if bool((self.limit[nbytes:] != BYTE_FILL).any()):
            problems.append(f"limit: bytes after the first {nbytes} lost their fill")
        return problems


# --------------------------------------------------------------------------
# Strategies


def zero_per_layer(pools: Pools, ids) -> int:
    """(a) The PyTorch-engine way: index_fill_ on each layer's K and V pool.

    Returns the number of tensor ops issued (one kernel each on cuda).
    Note that `pool[ids].zero_()` would zero a copy: advanced indexing
    gathers, which is why engines use index_fill_ or `pool[ids] = 0`.
    """
    for k, v in pools.views:
        k.index_fill_(0, ids, 0)
        v.index_fill_(0, ids, 0)
    return 2 * len(pools.views)


def zero_limit(pools: Pools, nbytes: int) -> int:
    """(c) The limit: one zero_() of `nbytes` contiguous bytes. Returns 1."""
    pools.limit[:nbytes].zero_()
    return 1


class TritonZeroer:
    """(b) One Triton kernel zeroing a batch of blocks in every pool.

    The kernel reads a device table of (base address, block stride, block
    size) per pool, in 8-byte words, like vLLM's KVBlockZeroer's pointer
    table; program (i, c) zeroes chunk c of block ids[i // pools] in pool
    i % pools. The table is built once per cache, outside the timing.
    """

    CHUNK_WORDS = 1024  # 8 KiB per program
    MAX_GRID_Y = 65535

    def __init__(self, torch, triton, pools: Pools):
        self.torch = torch
        self.triton = triton
        rows = []
        for t, stride, size in pools.regions:
            if t.data_ptr() % 8 or stride % 8 or size % 8:
                raise ValueError("a pool is not 8-byte aligned")
            rows.append([t.data_ptr(), stride // 8, size // 8])
        self.table = torch.tensor(rows, dtype=torch.int64, device=pools.storage[0].device)
        self.num_regions = len(rows)
        max_words = max(r[2] for r in rows)
        self.chunks = -(-max_words // self.CHUNK_WORDS)
        if self.chunks > self.MAX_GRID_Y:
            raise ValueError(f"a block region of {max_words * 8} bytes is too large for one grid")
        self.kernel = _triton_kernel()

    def __call__(self, ids) -> int:
        """Zeroes blocks `ids` (an int64 device tensor); returns 1 launch."""
        grid = (ids.numel() * self.num_regions, self.chunks)
        self.kernel[grid](self.table, ids, self.num_regions, CHUNK=self.CHUNK_WORDS)
        return 1


_KERNEL = None


def _triton_kernel():
    """The @triton.jit kernel, defined on first use so that importing this
    module needs no triton."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def zero_blocks_kernel(table_ptr, ids_ptr, num_regions, CHUNK: tl.constexpr):
            pair = tl.program_id(0)
            chunk = tl.program_id(1)
            block = tl.load(ids_ptr + pair // num_regions).to(tl.int64)
            row = table_ptr + (pair % num_regions) * 3
            base = tl.load(row).to(tl.pointer_type(tl.int64))
            stride = tl.load(row + 1)
            words = tl.load(row + 2)
            offs = chunk * CHUNK + tl.arange(0, CHUNK)
            tl.store(
                base + block * stride + offs, tl.zeros([CHUNK], dtype=tl.int64), mask=offs < words
            )

        _KERNEL = zero_blocks_kernel
    return _KERNEL


# --------------------------------------------------------------------------
# Timing


class Timer:
    """Seconds per call of a zeroing function: torch.cuda.Event on cuda,
    time.perf_counter on cpu; the median of `repetitions` after `warmup`."""

    def __init__(self, torch, device, warmup: int, repetitions: int):
        self.torch = torch
        self.cuda = device.type == "cuda"
        self.warmup = warmup
        self.repetitions = repetitions

    def __call__(self, work: Callable[[], int]) -> Tuple[float, int]:
        """(median seconds, launches per call) of `work`."""
        launches = 0
        for _ in range(self.warmup):
            launches = work()
        if self.cuda:
            self.torch.cuda.synchronize()
        times = []
        for _ in range(self.repetitions):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                stop = self.torch.cuda.Event(enable_timing=True)
                start.record()
                launches = work()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            else:
                t0 = time.perf_counter()
                launches = work()
                times.append(time.perf_counter() - t0)
        return statistics.median(times), launches


def measure_case(
    pools: Pools, case: Case, timer: Timer, triton_zeroer: Optional[TritonZeroer]
) -> Dict[str, Optional[StrategyResult]]:
    """The three strategies on one case, each from freshly filled pools and
    verified after its timed runs."""
    torch = pools.torch
    nbytes = case.batch * pools.shape.bytes_per_block()
    ids = torch.tensor(case.block_ids, dtype=torch.long, device=pools.storage[0].device)
    runs: List[Tuple[str, Callable[[], int], Callable[[], List[str]]]] = [
        (
            "torch_per_layer",
            lambda: zero_per_layer(pools, ids),
            lambda: pools.check_blocks(case.block_ids),
        ),
    ]
    if triton_zeroer is not None:
        runs.append(
            ("triton", lambda: triton_zeroer(ids), lambda: pools.check_blocks(case.block_ids))
        )
    runs.append(("limit", lambda: zero_limit(pools, nbytes), lambda: pools.check_limit(nbytes)))
    results: Dict[str, Optional[StrategyResult]] = {
        "torch_per_layer": None,
        "triton": None,
        "limit": None,
    }
    for name, work, check in runs:
        pools.fill()
        try:
            seconds, launches = timer(work)
            if timer.cuda:
                torch.cuda.synchronize()
        except Exception as e:
            if name != "triton":
                raise
            # A kernel that does not compile or launch: the other strategies
            # are still measured, and the run fails at the end.
            raise TritonFailed(f"{type(e).__name__}: {e}", results) from e
        problems = check()
        results[name] = StrategyResult(
            seconds, nbytes / seconds if seconds > 0 else 0.0, launches, not problems, problems
        )
    return results


class TritonFailed(Exception):
    """The Triton strategy raised; `results` holds what was measured before it."""

    def __init__(self, message: str, results: Dict[str, Optional[StrategyResult]]):
        super().__init__(message)
        self.results = results


# --------------------------------------------------------------------------
# Driver


def triton_status(torch, device) -> Tuple[Optional[object], Optional[str], Optional[str]]:
    """(triton module, version, reason it is not used) for this device."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return None, None, f"triton is not importable: {e}"
    version = getattr(triton, "__version__", "unknown")
    if device.type != "cuda":
        return None, version, f"the Triton kernel needs a cuda device, this run is on {device.type}"
    return triton, version, None


def device_description(torch, device) -> str:
    """The device's name for the report."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads()
    return f"cpu ({threads} torch thread{'' if threads == 1 else 's'})"


def gb(bytes_per_s: float) -> str:
    """Throughput in GB/s (1e9 bytes), as text."""
    return f"{bytes_per_s / 1e9:.2f}"


ROW = "{:<16}  {:<11}  {:<10}  {:>5}  {:>12}  {:>10}  {:>8}  {:>8}  {:>9}  {:>6}"


def print_header(out) -> None:
    """The table's header."""
    print(
        ROW.format(
            "Model",
            "Layout",
            "Ids",
            "Batch",
            "Bytes",
            "torch GB/s",
            "triton",
            "limit",
            "launches",
            "t/lim",
        ),
        file=out,
    )
    print(ROW.format(*("-" * w for w in (16, 11, 10, 5, 12, 10, 8, 8, 9, 6))), file=out)


def print_row(out, case: Case, nbytes: int, results: Dict[str, Optional[StrategyResult]]) -> None:
    """One case's row, as soon as it is measured."""
    per_layer, triton, limit = results["torch_per_layer"], results["triton"], results["limit"]
    out.write(
        ROW.format(
            case.model,
            case.layout,
            case.ids_pattern,
            case.batch,
            nbytes,
            gb(per_layer.bytes_per_s),
            gb(triton.bytes_per_s) if triton else "-",
            gb(limit.bytes_per_s),
            f"{per_layer.launches}/{triton.launches if triton else '-'}/{limit.launches}",
            f"{per_layer.bytes_per_s / limit.bytes_per_s:.2f}x" if limit.bytes_per_s else "-",
        )
        + "\n"
    )
    out.flush()


def select_cases(args: argparse.Namespace) -> List[Case]:
    """The cases to measure: from --kvport-json, else every model x layout x
    batch x id pattern selected. Needs no torch, so bad input is reported
    where torch is missing too."""
    if args.kvport_json:
        return cases_from_kvport(args.kvport_json, make_shapes(args.small))
    return plan_cases(args.models, args.layouts, args.batches)


def run(args: argparse.Namespace, cases: List[Case], torch) -> int:
    """Measures every case and writes the report; returns the exit status."""
    shapes = make_shapes(args.small)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise Unavailable(
            "--device cuda: torch.cuda.is_available() is false (no GPU, or a CPU-only torch)"
        )
    device = torch.device(args.device)
    triton, triton_version, triton_reason = triton_status(torch, device)
    timer = Timer(torch, device, args.warmup, args.repetitions)

    print(
        f"{PROG}: block zeroing with torch {torch.__version__} on {device_description(torch, device)}; "
        f"{len(cases)} cases, median of {args.repetitions} after {args.warmup} warm-up"
    )
    print("  torch   index_fill_ per layer pool, K and V (2 x layers ops)")
    print(
        "  triton  one Triton kernel over every pool"
        + (f" (not run: {triton_reason})" if triton_reason else "")
    )
    print("  limit   one zero_() of the same bytes, contiguous\n")
    print_header(sys.stdout)

    report_cases = []
    failures = []
    triton_failed: Optional[str] = None
    # One cache alive at a time, per model, layout and cache size (kvport's
    # bench builds one per model and layout, for the largest batch).
    groups: Dict[Tuple[str, str, int], List[Case]] = {}
    for case in cases:
        groups.setdefault((case.model, case.layout, case.num_blocks), []).append(case)
    for (model, layout, num_blocks), group in groups.items():
        shape = shapes[model]
        limit_bytes = max(c.batch for c in group) * shape.bytes_per_block()
        pools = Pools(torch, shape, layout, num_blocks, limit_bytes, device)
        zeroer = None
        if triton is not None and not triton_failed:
            try:
                zeroer = TritonZeroer(torch, triton, pools)
            except Exception as e:
                triton_failed = f"the Triton zeroer could not be set up: {type(e).__name__}: {e}"
                failures.append(triton_failed)
        for case in group:
            nbytes = case.batch * shape.bytes_per_block()
            try:
                results = measure_case(pools, case, timer, zeroer)
            except TritonFailed as e:
                triton_failed = f"the Triton kernel failed: {e}"
                failures.append(f"{model} {layout} {case.ids_pattern} batch {case.batch}: {e}")
                zeroer = None
                results = measure_case(pools, case, timer, None)
            print_row(sys.stdout, case, nbytes, results)
            for name, r in results.items():
                for problem in r.problems if r else []:
                    failures.append(
                        f"{model} {layout} {case.ids_pattern} batch {case.batch}: {name}: {problem}"
                    )
            report_cases.append(
                {
                    "model": model,
                    "layout": layout,
                    "batch": case.batch,
                    "ids": case.ids_pattern,
                    "bytes": nbytes,
                    "num_blocks": num_blocks,
                    "torch_per_layer": results["torch_per_layer"].to_json(),
                    "triton": results["triton"].to_json() if results["triton"] else None,
                    "limit": results["limit"].to_json(),
                    "block_ids": case.block_ids,
                }
            )
        del zeroer, pools
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        "tool": PROG,
        "device": device_description(torch, device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "triton_reason": triton_failed or triton_reason,
        "small": args.small,
        "kvport_json": args.kvport_json,
        "timing": {
            "clock": "torch.cuda.Event" if device.type == "cuda" else "time.perf_counter",
            "statistic": "median",
            "warmup": args.warmup,
            "repetitions": args.repetitions,
        },
        "cases": report_cases,
    }
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
                f.write("\n")
        except OSError as e:
            raise BadInput(f"--out: cannot write {args.out}: {e.strerror}") from e

    print()
    if failures:
        for failure in failures:
            print(f"{PROG}: failed: {failure}", file=sys.stderr)
        print(f"Verify   FAILED: {len(failures)} problem(s), listed on stderr")
        return EXIT_VERIFY_FAILED
    print(f"Verify   ok: every strategy zeroed exactly its blocks ({len(report_cases)} cases)")
    return EXIT_OK


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported on one line (exit 2)."""

    def error(self, message: str):
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def positive(limit: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, limit]."""

    def parse(text: str) -> int:
        if not text.strip().isdigit() or not 1 <= int(text) <= limit:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer in [1, {limit}]")
        return int(text)

    return parse


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The command line, validated; raises BadInput or exits 2."""
    p = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0, 1 a verification failed, 2 bad input, 3 torch or the device missing.",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the pools live (default cuda)",
    )
    p.add_argument("--models", help=f"comma-separated models (default all: {','.join(MODELS)})")
    p.add_argument("--layouts", help="comma-separated layouts (default layer_major,block_major)")
    p.add_argument(
        "--batches", help="comma-separated batch sizes in blocks (default 1,16,256; --small 1,4,16)"
    )
    p.add_argument(
        "--repetitions",
        type=positive(MAX_REPETITIONS),
        default=5,
        help="timed runs per strategy and case (default 5)",
    )
    p.add_argument(
        "--warmup", type=positive(MAX_REPETITIONS), default=2, help="untimed runs first (default 2)"
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="CPU-friendly shapes (4 or 10 layers, 2 heads, head dim 16) and batches 1,4,16",
    )
    p.add_argument(
        "--kvport-json",
        metavar="FILE",
        help="take models, layouts, batches and the exact block ids from `kvport bench --json` output",
    )
    p.add_argument("--out", metavar="FILE", help="write the JSON report here")
    args = p.parse_args(argv)
    if args.kvport_json:
        given = [
            f
            for f, v in (
                ("--models", args.models),
                ("--layouts", args.layouts),
                ("--batches", args.batches),
                ("--small", args.small),
            )
            if v
        ]
        if given:
            raise BadInput(f"--kvport-json takes the cases from the file; drop {', '.join(given)}")
    args.models = (
        parse_list(args.models, MODELS, "--models") if args.models is not None else list(MODELS)
    )
    args.layouts = (
        parse_list(args.layouts, LAYOUTS, "--layouts")
        if args.layouts is not None
        else list(LAYOUTS)
    )
    if args.batches is not None:
        args.batches = parse_batches(args.batches)
    else:
        args.batches = list(SMALL_BATCHES if args.small else DEFAULT_BATCHES)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse, import torch, measure."""
    try:
        args = parse_args(argv)
        cases = select_cases(args)
        try:
            import torch
        except ImportError as e:
            raise Unavailable(
                f"torch is not importable ({e}); on Debian: scripts/deps.sh --peer"
            ) from e
        return run(args, cases, torch)
    except BadInput as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Unavailable as e:
        print(f"{PROG}: unavailable: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
