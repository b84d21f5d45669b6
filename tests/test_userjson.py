"""The strict reader for user JSON files: every hostile file is one SpecError-style line."""

from __future__ import annotations

import os

import pytest

from evenzero.userjson import MAX_NUMBER_DIGITS, brief, read_json_file


class Bad(ValueError):
    pass


def read(tmp_path, content: str | bytes):
    path = tmp_path / "f.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return read_json_file(path, Bad, "model file")


def refused(tmp_path, content: str | bytes) -> str:
    with pytest.raises(Bad) as info:
        read(tmp_path, content)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    return message


@pytest.mark.parametrize("content, expected", [
    ('{"a": [' + "9" * 5000 + "]}", "has an integer of 5,000 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b"\xff\xfe{}", "not UTF-8 text (byte 0xff at offset 0)"),
    ("", "empty model file"),
    (" \n\t", "empty model file"),
    ('{"a": NaN}', "has NaN, which is not valid JSON"),
    ('{"a": -Infinity}', "has -Infinity, which is not valid JSON"),
    ('{"a": 1e999}', "has a number out of range"),
    ('{"a": 1, "a": 2}', "has the key 'a' twice"),
    ('{"params": [{"name": "x", "name": "y"}]}', "has the key 'name' twice"),
    ('{"a": 1} trailing', "not valid JSON at line 1 column 10: Extra data"),
    ('{"a": 0.' + "1" * 200 + "}", "number literal of 202 characters"),
])
def test_hostile_content_is_one_line(tmp_path, content, expected):
    assert expected in refused(tmp_path, content)


def test_accepts_json_and_a_utf8_bom(tmp_path):
    assert read(tmp_path, '{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}
    assert read(tmp_path, b'\xef\xbb\xbf{"a": 1}') == {"a": 1}
    assert read(tmp_path, '{"a": ' + "9" * MAX_NUMBER_DIGITS + "}")["a"] == int("9" * MAX_NUMBER_DIGITS)


def test_files_that_are_not_regular_files(tmp_path):
    def message(path) -> str:
        with pytest.raises(Bad) as info:
            read_json_file(path, Bad, "model file")
        return str(info.value)

    assert "is a directory" in message(tmp_path)
    assert "not a regular file" in message("/dev/zero")  # would never finish reading
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert "not a regular file" in message(fifo)  # would block forever
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    assert "Too many levels of symbolic links" in message(loop)
    assert "No such file or directory" in message(tmp_path / "missing.json")
    (tmp_path / "f.json").write_text("{}")
    assert "Not a directory" in message(tmp_path / "f.json" / "x.json")


def test_brief_bounds_what_an_error_quotes():
    assert "..." in brief("x" * 10_000) and len(brief("x" * 10_000)) <= 60
    nested: list = []
    for _ in range(900):
        nested = [nested]
    assert len(brief(nested)) <= 60
    assert brief([1, 2]) == "[1, 2]"
