"""JSON files that users hand us (model specs, cost models), read strictly.

`json.load` alone turns hostile files into tracebacks: an integer of over 4,300 digits
raises ValueError (Python's int-str conversion limit), deep nesting RecursionError, a
non-UTF-8 file UnicodeDecodeError; reading /dev/zero or a FIFO never returns. It also accepts
what JSON does not (NaN, Infinity, 1e999 read as inf) and silently keeps the last of
duplicate keys. `read_json_file` refuses all of these with one line that names the file
and the problem, raised as the caller's own error class.
"""

from __future__ import annotations

import json
import math
import reprlib
import stat
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 256 * 2**20
"""Largest JSON file read (256 MiB): a spec of a million parameters is ~100 MB."""
MAX_NUMBER_DIGITS = 100
"""Longest number literal accepted; 2**63 has 19 digits, so this is only a guard against
literals that take quadratic time to convert (or exceed Python's 4,300-digit limit)."""


class _Refused(Exception):
    """A literal the strict parser refuses; turned into the caller's error class."""


def read_json_file(path: str | Path, error: type[Exception], what: str) -> Any:
    """Parse the JSON file at `path`; every failure raises `error` with one line.

    `what` names the file's role in messages ("model file", "cost model").
    """
    path = Path(path)
    text = _read_text(path, error, what)
    if not text.strip():
        raise error(f"{path}: empty {what}; expected a JSON object")
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_parse_constant, object_pairs_hook=_unique_keys)
    except _Refused as e:
        raise error(f"{path}: {what} {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise error(f"{path}: {what} is nested too deeply to parse (the documented "
                    f"format needs 4 levels)") from None


def brief(value: Any, limit: int = 60) -> str:
    """`repr(value)`, shortened, for an error message about user data."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring = 3, 8, 8, limit
    short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_text(path: Path, error: type[Exception], what: str) -> str:
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{path}: is a directory, not a {what}")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: not a regular file (a device, FIFO or socket); "
                        f"save the {what} to a file first")
        if info.st_size > MAX_FILE_BYTES:
            raise error(f"{path}: {what} is {info.st_size:,} bytes, over the limit of "
                        f"{MAX_FILE_BYTES:,}")
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise error(f"{path}: cannot read {what} ({reason})") from None
    if len(data) > MAX_FILE_BYTES:  # grew while we read it
        raise error(f"{path}: {what} is over the limit of {MAX_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                    f"offset {e.start}); save it as UTF-8 JSON") from None


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise _Refused(f"has an integer of {len(literal.lstrip('-')):,} digits "
                       f"(limit {MAX_NUMBER_DIGITS})")
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_DIGITS:
        raise _Refused(f"has a number literal of {len(literal):,} characters "
                       f"(limit {MAX_NUMBER_DIGITS})")
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"has a number out of range: {brief(literal)}")
    return value


def _parse_constant(name: str) -> Any:
    raise _Refused(f"has {name}, which is not valid JSON; use a finite number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"has the key {brief(key)} twice in one object; keep one")
        out[key] = value
    return out


__all__ = ["MAX_FILE_BYTES", "MAX_NUMBER_DIGITS", "brief", "read_json_file"]
