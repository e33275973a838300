"""Buffers of asynchronous collectives in Inductor's generated Python wrapper: is any touched while in flight?

Between a collective's issue and its ``wait_tensor`` the communication library reads the collective's input
and writes its output on another thread (gloo's worker threads) or stream (NCCL).  A wrapper that, in that
window, writes the input or touches the output, or hands either storage to another buffer (``# reuse``) or
frees it, races with the library: wrong values, or a heap written after it was freed.  Reordering moves
waits, so a schedule the passes return is checked here on the code Inductor generated for it.

>>> from torch._inductor.utils import run_and_get_code
>>> _, codes = run_and_get_code(step)                    # doctest: +SKIP
>>> assert not any(inflight_hazards(code) for code in codes)  # doctest: +SKIP

What counts as a write: a C++ kernel's non-``const`` pointer argument (its ``cpp_pybinding`` signature), an
extern kernel's ``out=``, and an in-place ``aten`` call's first argument; any other line naming a buffer (a
custom op such as the bucket copy-out, a view) reads it.  Storages are followed through
``reinterpret_tensor`` aliases and ``# reuse`` renames.  Only the Python wrapper (CPU, or GPU without the C++
wrapper) is read.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

__all__ = ["InflightHazard", "inflight_hazards"]

_COLLECTIVE = re.compile(r"^(\w+) = torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)$")
_WAIT = re.compile(r"^torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)$")
_REUSE = re.compile(r"^(\w+) = (\w+); del \2\s*# reuse$")
_ALIAS = re.compile(r"^(\w+) = reinterpret_tensor\((\w+),")
_DEL = re.compile(r"^del (\w+)$")
_CALL = re.compile(r"^(\w+)\((.*)\)$")
_EXTERN = re.compile(r"^extern_kernels\.\w+\((.*)\)$")
_INPLACE_ATEN = re.compile(r"^(?:aten|torch\.ops\.aten)\.\w+_\.\w+\((\w+)")
_CPP_SIGNATURE = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\])")
_WORD = re.compile(r"\b[A-Za-z_]\w*\b")
_NAME = re.compile(r"\b(?:reinterpret_tensor\()?([A-Za-z_]\w*)")


@dataclass(frozen=True)
class InflightHazard:
    """``line`` (1-based, in the wrapper) does ``what`` to a storage that collective ``collective`` (its
    output's name) still reads or writes."""

    line: int
    collective: str
    what: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what} while {self.collective} is in flight: {self.text}"


def _top_level_args(text: str) -> list[str]:
    """The call's positional and keyword arguments as source strings (``ast`` keeps nesting right)."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError:
        return []
    assert isinstance(call, ast.Call)
    return [ast.unparse(a) for a in call.args] + [f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords]


def _base_name(arg: str) -> str | None:
    """The buffer an argument reads (``buf3`` for ``reinterpret_tensor(buf3, ...)``), or None for a literal."""
    m = _NAME.match(arg.strip())
    return m.group(1) if m else None


def inflight_hazards(code: str) -> list[InflightHazard]:
    """Every line of Inductor's wrapper ``code`` that writes, frees or hands on a storage of a collective
    between its issue and its wait, and every collective still in flight when ``call`` returns."""
    signatures: dict[str, list[bool]] = {}  # C++ kernel -> is each argument written
    for raw in code.splitlines():
        m = _CPP_SIGNATURE.match(raw.strip())
        if m:
            signatures[m.group(1)] = [not t.startswith("const") for t in ast.literal_eval(m.group(2))]
    start = code.find("def call(")
    if start < 0:
        return []
    first_line = code.count("\n", 0, start) + 1
    root: dict[str, str] = {}  # buffer name -> the storage it lives in

    def storage(name: str) -> str:
        return root.get(name, name)

    inflight: dict[str, set[str]] = {}  # collective output (its own storage) -> every storage it uses
    hazards: list[InflightHazard] = []

    def touched(stor: str, what: str, lineno: int, text: str, *, reading: bool = False) -> None:
        for coll, stors in inflight.items():
            if stor in stors and not (reading and stor != coll):
                hazards.append(InflightHazard(lineno, coll, what, text))

    for offset, raw in enumerate(code[start:].splitlines()):
        text = raw.strip()
        lineno = first_line + offset
        if not text or text.startswith("#"):
            continue
        if text.startswith("return "):
            for coll in inflight:
                hazards.append(InflightHazard(lineno, coll, "returned without a wait", text))
            break
        if m := _COLLECTIVE.match(text):
            out, args = m.group(1), _top_level_args(m.group(3))
            stors = {storage(b) for b in map(_base_name, args) if b}
            root[out] = out
            inflight[out] = stors | {out}
            continue
        if m := _WAIT.match(text):
            inflight.pop(m.group(1), None)
            continue
        if m := _REUSE.match(text):
            new, old = m.group(1), m.group(2)
            touched(storage(old), f"{old} reused as {new}", lineno, text)
            root[new] = storage(old)
            continue
        if m := _ALIAS.match(text):
            root[m.group(1)] = storage(m.group(2))
            continue
        if m := _DEL.match(text):
            name = m.group(1)
            if storage(name) == name:  # deleting an alias frees nothing
                touched(name, f"{name} freed", lineno, text)
            continue
        if m := _EXTERN.match(text):
            for arg in _top_level_args(m.group(1)):
                if arg.startswith("out="):
                    b = _base_name(arg[4:])
                    if b:
                        touched(storage(b), f"{b} written", lineno, text)
                else:
                    b = _base_name(arg)
                    if b:
                        touched(storage(b), f"{b} read", lineno, text, reading=True)
            continue
        if m := _INPLACE_ATEN.match(text):
            touched(storage(m.group(1)), f"{m.group(1)} written in place", lineno, text)
            continue
        if (m := _CALL.match(text)) and m.group(1) in signatures:
            writes = signatures[m.group(1)]
            for arg, written in zip(_top_level_args(m.group(2)), writes):
                b = _base_name(arg)
                if b:
                    touched(storage(b), f"{b} {'written' if written else 'read'}", lineno, text,
                            reading=not written)
            continue
        if not text.startswith("assert_"):  # any other op (a custom op's call, a view) that names a buffer reads it
            for name in set(_WORD.findall(text)):
                if name in root:
                    touched(storage(name), f"{name} read", lineno, text, reading=True)
    return hazards
