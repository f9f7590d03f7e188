"""Read IREE's stream IR of the training step: hazards, in-place updates and memory.

IREE can schedule the in-place update of a donated parameter before a later read of
its old value, which silently trains wrong. The fused step ties every update to the
parameter's last reads; `analyze` verifies on the compiled program that it worked, and
measures what the in-place updates save.

At the stream level (`--compile-to=stream`) the donated state arrives as
`stream.tensor.import ... consume %argK` resources. They pass through
`util.optimization_barrier`, `stream.timepoint.await` and `stream.resource.subview`
(followed back to the import), and are bound into `stream.cmd.execute` regions whose
commands list their accesses as `ro`, `wo` or `rw`. The commands are walked in program
order; any read of a donated resource after another command wrote it is reported, and
so is a read and a write of one resource by two commands of one `stream.cmd.concurrent`
block (they may run in any order). This is conservative: a legitimate read of a freshly
written value would be reported too (none occurs in the steps pockjax builds, since each
update reads the old value only inside its own dispatch).

Commands inside loops (`scf.for` / `scf.while` at the stream level) are walked once, in
text order; the update of a parameter is placed after the loop that reads it.
"""
from __future__ import annotations

import dataclasses
import re

__all__ = ["StreamReport", "analyze", "narrow_bindings"]

_SSA = r"%[\w.$#-]+"
_CONST = re.compile(r"(%[\w]+) = arith\.constant (\d+) : index")
_IMPORT = re.compile(rf"({_SSA}) = stream\.tensor\.import[^\n]*?(consume )?(%arg\d+) : [^\n]*?"
                     rf"!stream\.resource<\w+>\{{({_SSA})\}}")
_BARRIER = re.compile(rf"({_SSA})(?::(\d+))? = util\.optimization_barrier ([^:]+):")
_AWAIT = re.compile(rf"({_SSA})(?::(\d+))? = stream\.timepoint\.await [^\n]*?=> ([^:]+):")
_SUBVIEW = re.compile(rf"({_SSA}) = stream\.resource\.subview ({_SSA})\[")
_ALLOCA = re.compile(rf"({_SSA}), {_SSA} = stream\.resource\.alloca [^\n]*?(?::|=>) "
                     rf"!stream\.resource<(\w+)>\{{({_SSA})\}}")
_DEALLOCA = re.compile(rf"stream\.resource\.dealloca [^\n]*?=> ({_SSA}) :")
_EXPORT = re.compile(rf"({_SSA}) = stream\.tensor\.export [^\n]*? ({_SSA}) : ")
_RETURN = re.compile(r"util\.return ([^:]+):")
_BIND = re.compile(rf"({_SSA}) as (%arg\d+):")
_ACCESS = re.compile(r"\b(ro|rw|wo) (%arg\d+)\[")
_COPY = re.compile(r"stream\.cmd\.copy (%arg\d+)\[[^\]]*\], (%arg\d+)\[")
_FILL = re.compile(r"stream\.cmd\.fill [^,]+, (%arg\d+)\[")


@dataclasses.dataclass
class StreamReport:
    """What the stream IR of one function shows.

    Attributes:
      hazards: reads of a donated argument after its in-place write, or while another
        command of the same concurrent block may write it, one message each (empty
        when safe).
      not_in_place: the state names of donated arguments whose output is not the
        argument's own buffer.
      input_bytes: the bytes of the function's imported arguments (donated state and
        batch).
      peak_alloc_bytes: the most bytes allocated by the step at one point (transients,
        outputs and staging; the frozen weights are constants and not included).
      submissions: the number of `stream.cmd.execute` regions (device submissions).
    """

    hazards: list[str]
    not_in_place: list[str]
    input_bytes: int
    peak_alloc_bytes: int
    submissions: int

    @property
    def peak_bytes(self) -> int:
        """`input_bytes + peak_alloc_bytes`: the step's peak device memory besides constants."""
        return self.input_bytes + self.peak_alloc_bytes


def _function(text: str, name: str) -> str:
    m = re.search(rf"util\.func public @{re.escape(name)}\(", text)
    if not m:
        raise ValueError(f"function @{name} not found in the stream IR")
    nxt = re.search(r"\n  util\.func ", text[m.end():])
    return text[m.start(): m.end() + nxt.start()] if nxt else text[m.start():]


def _results(name: str, count: str | None) -> list[str]:
    return [name] if count is None else [f"{name}#{i}" for i in range(int(count))]


def _operands(text: str) -> list[str]:
    return re.findall(_SSA, text)


class _Walker:
    def __init__(self, donated: dict[int, str]):
        self.donated = donated          # argument index -> state name
        self.root: dict[str, int] = {}  # SSA value -> donated argument index
        self.written: dict[int, str] = {}
        self.hazards: list[str] = []

    def alias(self, results: list[str], operands: list[str]) -> None:
        for r, o in zip(results, operands):
            if o in self.root:
                self.root[r] = self.root[o]

    def commands(self, body: str, binds: dict[str, str]):
        """Execute-region commands as groups: each group's commands may run in any order."""
        groups: list[list[tuple[str, set, set]]] = []
        concurrent = False
        current = None
        for line in body.splitlines():
            s = re.sub(r" loc\(.*$", "", line).strip()
            if s.startswith("stream.cmd.concurrent"):
                concurrent = True
                groups.append([])
                continue
            if s == "}" and current is None and concurrent:
                concurrent = False
                continue
            cmd = None
            if s.startswith("stream.cmd.copy") and (m := _COPY.search(s)):
                cmd = ("copy", {m.group(1)}, {m.group(2)})
            elif s.startswith("stream.cmd.fill") and (m := _FILL.search(s)):
                cmd = ("fill", set(), {m.group(1)})
            elif s.startswith("stream.cmd.dispatch"):
                current = cmd = (s.split()[1].split("(")[0].split("[")[0], set(), set())
            elif current is not None:
                for mode, arg in _ACCESS.findall(s):
                    (current[1] if mode == "ro" else current[2]).add(arg)
                    if mode == "rw":
                        current[1].add(arg)
                if s.startswith("}"):
                    current = None
                continue
            if cmd is not None:
                if concurrent:
                    groups[-1].append(cmd)
                else:
                    groups.append([cmd])
        for group in groups:
            resolved = []
            for label, reads, writes in group:
                rd = {self.root[binds[a]] for a in reads if binds.get(a) in self.root}
                wr = {self.root[binds[a]] for a in writes if binds.get(a) in self.root}
                resolved.append((label, rd, wr))
            for label, rd, wr in resolved:
                for k in rd - wr:
                    if k in self.written:
                        self._hazard(k, label, f"after {self.written[k]} wrote it in place")
                    others = [l for l, _, w in resolved if l != label and k in w]
                    if others:
                        self._hazard(k, label, f"while {others[0]} may write it concurrently")
            for label, _, wr in resolved:
                for k in wr:
                    self.written.setdefault(k, label)

    def _hazard(self, k: int, label: str, why: str) -> None:
        self.hazards.append(f"'{self.donated.get(k, f'argument {k}')}' is read by {label} {why}")


def analyze(stream_ir: str, donated: dict[int, str], function: str = "train_step") -> StreamReport:
    """Check `function` in `stream_ir` for hazards and in-place updates, and measure it.

    Args:
      stream_ir: the module's stream IR (`--compile-to=stream`) as text.
      donated: donated argument index -> state name; output `i` of a donated argument
        `i` must be that argument's buffer.
      function: the public function to read (default `"train_step"`).

    Returns:
      The `StreamReport` of the function.

    Raises:
      ValueError: `stream_ir` has no public function `function`.
    """
    fn = _function(stream_ir, function)
    consts = {name: int(v) for name, v in _CONST.findall(stream_ir)}
    size = lambda ssa: consts.get(ssa, 0)
    w = _Walker(donated)
    input_bytes = 0
    live, peak = 0, 0
    alloc: dict[str, int] = {}
    exports: dict[str, str] = {}
    returns: list[str] = []
    submissions = 0
    lines = fn.splitlines()
    i = 0
    while i < len(lines):
        line = re.sub(r" loc\(.*$", "", lines[i])
        i += 1
        if m := _IMPORT.search(line):
            k = int(m.group(3)[4:])
            input_bytes += size(m.group(4))
            if m.group(2) and k in donated:
                w.root[m.group(1)] = k
        elif m := _BARRIER.search(line):
            w.alias(_results(m.group(1), m.group(2)), _operands(m.group(3)))
        elif m := _AWAIT.search(line):
            w.alias(_results(m.group(1), m.group(2)), _operands(m.group(3)))
        elif m := _SUBVIEW.search(line):
            w.alias([m.group(1)], [m.group(2)])
        elif m := _ALLOCA.search(line):
            alloc[m.group(1)] = size(m.group(3))
            live += alloc[m.group(1)]
            peak = max(peak, live)
        elif m := _DEALLOCA.search(line):
            live -= alloc.pop(m.group(1), 0)
        elif m := _EXPORT.search(line):
            exports[m.group(1)] = m.group(2)
        elif m := _RETURN.search(line):
            returns = _operands(m.group(1))
        elif "stream.cmd.execute" in line and " with(" in line:
            submissions += 1
            binds = {arg: ssa for ssa, arg in _BIND.findall(line)}
            body = []
            while i < len(lines) and not re.match(r"\s*\} => ", lines[i]):
                body.append(lines[i])
                i += 1
            w.commands("\n".join(body), binds)
    not_in_place = []
    for k, name in sorted(donated.items()):
        out = exports.get(returns[k]) if k < len(returns) else None
        if out is None or w.root.get(out) != k:
            not_in_place.append(name)
    return StreamReport(w.hazards, not_in_place, input_bytes, peak, submissions)


_BINDING = re.compile(r"dispatch\.tensor<(?:readonly|writeonly|readwrite):tensor<((?:[\d?]+x)*)"
                      r"([a-z]+\d+)>")


def narrow_bindings(stream_text: str, *, scalars: bool = False) -> dict[str, int]:
    """Element types narrower than 32 bits of the arrays kernels read or write in memory.

    Args:
      stream_text: the module's stream IR as text.
      scalars: also count 0-d tensors; by default only arrays with dimensions count.

    Returns:
      Element type (`i1`, `i8`, `f16`, ...) -> its storage width in bits (8 for
      anything of 8 bits or fewer).
    """
    out = {}
    for dims, dtype in set(_BINDING.findall(stream_text)):
        bits = int(re.sub(r"\D", "", dtype))
        if bits < 32 and (dims or scalars):
            out[dtype] = 8 if bits <= 8 else bits
    return out
