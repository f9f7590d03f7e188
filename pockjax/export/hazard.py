"""Check IREE's stream IR: no trained parameter is read after its in-place write.

IREE 3.13 can schedule the in-place update of a parameter before a later read of the
old value, which silently trains wrong. The fused step ties every update to the
parameter's last reads; this check verifies, on the compiled program, that it worked.

In stream IR the state globals are `!stream.resource<variable>` resources (IREE may
pack several globals into one) bound into `stream.cmd.execute` regions; each command
lists its accesses as `ro`, `wo` or `rw`. Commands of one region are walked in order,
and any read of a loaded state resource after a command wrote into that same resource
in place is reported. This is conservative: IREE 3.13 writes a step's new state into
freshly allocated resources and stores those into the globals (no in-place write, so
nothing to report), and a future in-place schedule is refused until proven safe.
"""
from __future__ import annotations

import re

__all__ = ["find_hazards"]

_LOAD = re.compile(r"(%[\w.$-]+) = util\.global\.load @([\w.$-]+) : !stream\.resource<variable>")
_BIND = re.compile(r"(%[\w.$#-]+) as (%arg\d+):")
_ACCESS = re.compile(r"\b(ro|rw|wo) (%arg\d+)\[")
_COPY = re.compile(r"stream\.cmd\.copy (%arg\d+)\[[^\]]*\], (%arg\d+)\[")
_FILL = re.compile(r"stream\.cmd\.fill [^,]+, (%arg\d+)\[")


def _function(text: str, name: str) -> str:
    m = re.search(rf"util\.func public @{re.escape(name)}\(", text)
    if not m:
        raise ValueError(f"function @{name} not found in the stream IR")
    nxt = re.search(r"\n  util\.func ", text[m.end():])
    return text[m.start(): m.end() + nxt.start()] if nxt else text[m.start():]


def _commands(body: str):
    """(label, reads, writes) per command of an execute region, in order."""
    cmds = []
    current = None
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("stream.cmd.copy"):
            m = _COPY.search(s)
            if m:
                cmds.append(("copy", {m.group(1)}, {m.group(2)}))
            continue
        if s.startswith("stream.cmd.fill"):
            m = _FILL.search(s)
            if m:
                cmds.append(("fill", set(), {m.group(1)}))
            continue
        if s.startswith("stream.cmd.dispatch"):
            label = s.split()[1].split("(")[0]
            current = (label, set(), set())
            cmds.append(current)
            continue
        if current is not None:
            for mode, arg in _ACCESS.findall(s):
                (current[1] if mode == "ro" else current[2]).add(arg)
                if mode == "rw":
                    current[1].add(arg)
            if s.startswith("}"):
                current = None
    return cmds


def find_hazards(stream_ir: str, names: dict[str, str], function: str = "train_step") -> list[str]:
    """Hazards in `function`; `names` maps global symbols (without '@') to state names."""
    fn = _function(stream_ir, function)
    ssa_to_global = {ssa: sym for ssa, sym in _LOAD.findall(fn)}
    hazards = []
    for ex in re.finditer(r"stream\.cmd\.execute[^\n]*?with\((.*?)\) \{\n(.*?)\n    \} =>", fn, re.S):
        binds = {arg: ssa for ssa, arg in _BIND.findall(ex.group(1))}
        written: dict[str, str] = {}
        for label, reads, writes in _commands(ex.group(2)):
            for arg in reads:
                sym = ssa_to_global.get(binds.get(arg, ""))
                if sym is not None and arg in written and arg not in writes:
                    hazards.append(f"state resource @{sym} ('{names.get(sym, sym)}', possibly "
                                   f"packed with other globals) is read by {label} after "
                                   f"{written[arg]} wrote it in place")
            for arg in writes:
                written.setdefault(arg, label)
    return hazards
