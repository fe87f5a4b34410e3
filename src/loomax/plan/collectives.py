"""The collectives of a compiled program and the bytes each device sends for them.

Read from the optimized HLO text (``compiled.as_text()``), which is what runs: every
all-gather, all-reduce, reduce-scatter, all-to-all (ragged too), collective-permute and
collective-broadcast, synchronous or split into ``-start``/``-done`` (or wrapped in an
``async-start``), times how often it runs: a collective in a loop body counts once per
iteration (the trip count from XLA's ``known_trip_count``, else the loop condition's
``i < N`` constant; a loop whose count is not found counts once and is reported), every
branch of a conditional counts (an upper bound).

Bytes a device sends, from the result's size ``S`` (all arrays of a tuple result; for a
ragged all-to-all the smaller of its input and its output buffer: the mean routed rows a
device sends, in either direction, where one call carries all of them; a form that makes
one call per local expert is charged that many times over) and the group's size ``n``, as a ring schedule moves them: all-gather and all-to-all ``S (n-1)/n``, reduce-scatter ``S (n-1)``, all-reduce ``2 S (n-1)/n``, collective-permute
and -broadcast ``S``. An asynchronous collective counts as *overlapped* where the schedule
(the compiled module is scheduled) puts compute (a fusion, dot, convolution, custom call,
loop or call) between its start and its done; the rest are *serial*: nothing hides them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from loomax.plan.topology import Topology

KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "ragged-all-to-all",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_OP = re.compile(r"\s(" + "|".join(KINDS) + r")(-start)?\(")
_DONE = re.compile(r"\s(?:" + "|".join(KINDS) + r"|async)-done\((%[\w.\-]+)")
_ASYNC = re.compile(r"\sasync-start\(")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=")
_HEADER = re.compile(r"^(ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=(%[\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8e[\w]+|token)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONST = re.compile(r"constant\((\d+)\)")
_COMPUTE = re.compile(r"\s(fusion|dot|convolution|custom-call|while|call|conditional)\(")
_BITS = {"pred": 8, "bf16": 16, "token": 0}


@dataclass
class Collective:
    """One collective instruction and what it sends, per device, each time it runs."""

    kind: str
    bytes: float
    """Bytes one device sends each time it runs (see the module's docstring)."""
    group: int
    times: float = 1.0
    """How often it runs a step (loop trip counts)."""
    overlapped: bool = False
    """Asynchronous, with compute scheduled between its start and its done."""


@dataclass
class Traffic:
    """The collectives of a compiled step, per device."""

    collectives: list[Collective] = field(default_factory=list)
    unknown_loops: int = 0
    """Loops with collectives whose trip count was not found (counted once)."""

    @property
    def bytes(self) -> float:
        return sum(c.bytes * c.times for c in self.collectives)

    @property
    def overlapped_bytes(self) -> float:
        return sum(c.bytes * c.times for c in self.collectives if c.overlapped)

    @property
    def serial_bytes(self) -> float:
        return self.bytes - self.overlapped_bytes

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.bytes * c.times
        return out


def array_bytes(text: str) -> float:
    """Bytes of every array shape in ``text`` (an HLO type, a tuple's too)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(text):
        bits = _BITS.get(dtype)
        if bits is None:
            found = re.search(r"\d+", dtype)
            bits = int(found.group()) if found else 32
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * bits / 8
    return total


def group_size(line: str, devices: int) -> int:
    """Devices in one replica group of the collective on ``line``."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']+)'", m.group(2)))
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", line):
        dims = [int(d) for d in m.group(1).split(",")]
        return dims[-1] if len(dims) > 1 else dims[0]
    if m := re.search(r"replica_groups=\{\{([\d,\s]*)\}", line):
        return max(1, len([x for x in m.group(1).split(",") if x.strip()]))
    return devices


def sent_bytes(kind: str, size: float, n: int) -> float:
    """Bytes one device sends for a collective whose result is ``size`` bytes over ``n``."""
    if n <= 1 and kind not in ("collective-permute", "collective-broadcast"):
        return 0.0
    if kind == "all-reduce":
        return 2 * size * (n - 1) / n
    if kind == "reduce-scatter":
        return size * (n - 1)
    if kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
        return size * (n - 1) / n
    return size  # collective-permute, collective-broadcast


def _result_type(line: str, match: re.Match) -> str:
    head = line[: match.start()]
    return head.split("=", 1)[1] if "=" in head else head


def _start_size(kind: str, result: str) -> float:
    """The output's bytes of an asynchronous start, whose result is a tuple of the operands,
    the outputs and, for some, context scalars."""
    arrays = [array_bytes(f"{d}[{s}]") for d, s in _ARRAY.findall(result)]
    arrays = [a for a in arrays if a > 4] or arrays
    if not arrays:
        return 0.0
    if kind == "all-gather":
        return max(arrays)
    if kind == "reduce-scatter":
        return min(arrays)
    if kind == "all-reduce":
        return sum(arrays)
    return arrays[len(arrays) // 2] if len(arrays) > 1 else arrays[0]


def _operand_bytes(lines: list[str], args: str) -> float:
    """Bytes of the first operand in ``args`` (the text after an op's ``(``), from the line
    in ``lines`` that defines it."""
    first = re.match(r"\s*(%[\w.\-]+)", args)
    if not first:
        return 0.0
    for line in lines:
        name = _NAME.match(line)
        if name and name.group(1) == first.group(1):
            found = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s[a-z][\w\-]*\(", line)
            return array_bytes(found.group(1)) if found else 0.0
    return 0.0


def _computations(text: str) -> tuple[dict[str, list[str]], str | None, list[str]]:
    """Each computation's lines by name, the entry's name, and the names in text order."""
    comps: dict[str, list[str]] = {}
    order: list[str] = []
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "->" in line:
                current = m.group(2)
                comps[current], _ = [], order.append(current)
                if m.group(1):
                    entry = current
            continue
        if line.rstrip() == "}":  # a kernel's config may hold newlines, and lines of "}}, ..."
            current = None
            continue
        comps[current].append(line)
    return comps, entry, order


def _trip_count(line: str, comps: dict[str, list[str]]) -> int | None:
    if m := _TRIP.search(line):
        return int(m.group(1))
    cond = re.search(r"condition=(%[\w.\-]+)", line)
    body = comps.get(cond.group(1), []) if cond else []
    if any("direction=LT" in c for c in body):
        consts = [int(x) for c in body for x in _CONST.findall(c)]
        if len(consts) == 1:
            return consts[0]
    return None


def traffic(text: str, devices: int) -> Traffic:
    """The collectives of the HLO module ``text`` (compiled for ``devices`` devices)."""
    comps, entry, order = _computations(text)
    if entry is None:
        return Traffic()
    times = {name: 0.0 for name in comps}
    times[entry] = 1.0
    async_called: dict[str, bool] = {}
    out = Traffic()
    unknown: set[str] = set()
    for name in reversed(order):  # callers come after their callees in HLO text
        mult = times.get(name, 0.0)
        lines = comps[name]
        for i, line in enumerate(lines):
            called = _CALLED.findall(line)
            branches = _BRANCHES.search(line)
            trip = 1
            if " while(" in line:
                found = _trip_count(line, comps)
                trip = found if found is not None else 1
                if found is None:
                    unknown.add(line)
            for role, callee in called:
                if callee in times:
                    times[callee] += mult * (trip if role in ("body", "condition") else 1)
                    if _ASYNC.search(line):
                        async_called[callee] = _work_before_done(lines, i, line)
            if branches:
                for callee in re.findall(r"%[\w.\-]+", branches.group(1)):
                    if callee in times:
                        times[callee] += mult
            op = _OP.search(line)
            if not op or mult == 0:
                continue
            kind, start = op.group(1), op.group(2)
            result = _result_type(line, op)
            size = _start_size(kind, result) if start else array_bytes(result)
            if kind == "ragged-all-to-all":  # at most its input's rows, into its buffer
                size = min(size, _operand_bytes(lines, line[op.end() :]) or size)
            if start:
                overlapped = _work_before_done(lines, i, line)
            else:
                overlapped = async_called.get(name, False)
            out.collectives.append(
                Collective(
                    kind,
                    sent_bytes(kind, size, group_size(line, devices)),
                    group_size(line, devices),
                    mult,
                    overlapped,
                )
            )
    out.unknown_loops = sum(1 for line in unknown if _has_collectives(line, comps))
    return out


def _work_before_done(lines: list[str], start: int, line: str) -> bool:
    """Whether compute is scheduled between the start on ``lines[start]`` and its done."""
    name = _NAME.match(line)
    if not name:
        return False
    for later in lines[start + 1 :]:
        done = _DONE.search(later)
        if done and done.group(1) == name.group(1):
            return False
        if _COMPUTE.search(later):
            return True
    return False


def _has_collectives(line: str, comps: dict[str, list[str]]) -> bool:
    body = re.search(r"body=(%[\w.\-]+)", line)
    return bool(body) and any(_OP.search(c) for c in comps.get(body.group(1), []))


def communication(moved: Traffic, topology: Topology) -> tuple[float, float, str | None]:
    """``(serial seconds, overlapped seconds, what they are)`` of ``moved`` on ``topology``:
    each collective's bytes at the link bandwidth, or between slices or hosts where its
    group is larger than one slice or host (an approximation: a smaller group may span them
    too)."""
    link, cross = topology.link_per_device, topology.cross_per_device
    if not moved.collectives:
        return 0.0, 0.0, None
    if not link:
        return (
            0.0,
            0.0,
            (
                f"communication: {moved.bytes / 1e9:.3g} GB a device a step in collectives, not "
                "timed (no link bandwidth known for these devices)"
            ),
        )
    domain = topology.devices_per_domain
    serial = overlapped = crossing = 0.0
    for c in moved.collectives:
        rate = cross if cross and c.group > domain else link
        crossing += c.bytes * c.times if rate is not link else 0.0
        seconds = c.bytes * c.times / rate
        if c.overlapped:
            overlapped += seconds
        else:
            serial += seconds
    gpu = topology.platform == "gpu"
    kinds = ", ".join(f"{k} {_size(b)}" for k, b in sorted(moved.by_kind().items()))
    share = moved.overlapped_bytes / moved.bytes if moved.bytes else 0.0
    text = (
        f"communication: {_size(moved.bytes)} a device a step ({kinds}) at "
        f"{link / 1e9:,.0f} GB/s a device ({'NVLink' if gpu else 'ICI'}: half the published "
        "bidirectional bandwidth, all links, one direction; a collective over one mesh axis "
        f"uses fewer) = {_span(serial + overlapped)}; {share:.0%} of "
        "the bytes asynchronous with compute scheduled before their done; best: all hidden "
        "behind compute, expected: that part hidden and the rest added, worst: all added"
    )
    if crossing:
        text += (
            f"; {_size(crossing)} in groups larger than one "
            f"{'host' if gpu else 'slice'} at {cross / 1e9:,.1f} GB/s "
            f"({'InfiniBand' if gpu else 'DCN'})"
        )
    if moved.unknown_loops:
        text += f"; {moved.unknown_loops} loop(s) of unknown trip count counted once"
    return serial, overlapped, text


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _span(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"
