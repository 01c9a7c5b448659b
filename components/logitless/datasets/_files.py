"""Local data files (JSON, JSON lines, CSV) checked for what makes a loader fail, so an error names the
file and the row, line or byte offset instead of the parser's bare position.

HF ``datasets`` reports a broken JSON file as "An error occurred while generating the dataset", an
empty one as a bare ``StopIteration`` and ``[]`` as 'Instruction "train" corresponds to no data!';
bytes that are not UTF-8 load without a word and fail at the first read of their column, whenever
that is. The builders of this package check each local text file's encoding before loading
(:func:`check_encoding`: one streaming pass, about a second per GB) and, only when loading fails or
gives no row, read the files again with :func:`data_file_problem` to say what is wrong and where.

Example:
    >>> data_file_problem("rows.jsonl")
    "'rows.jsonl' row 1 (line 2, column 30, byte offset 64): Expecting value; expected one JSON object per line"
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from typing import Any, List, Optional

#: ``source`` values of HF ``load_dataset`` whose ``data_files`` are text this module can read.
TEXT_LOADERS = ("json", "csv", "text")
#: Bytes read at a time by the encoding check.
READ_BLOCK = 1 << 22


def local_data_files(data_files: Any) -> List[str]:
    """The local files named by ``data_files`` (a path, a list, a ``{split: ...}`` mapping; globs expanded).

    Example:
        >>> local_data_files({"train": ["a.jsonl", "b.jsonl"]})
        ['a.jsonl', 'b.jsonl']
    """
    if data_files is None:
        return []
    if isinstance(data_files, (str, os.PathLike)):
        path = os.fspath(data_files)
        return sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    values = data_files.values() if hasattr(data_files, "values") else data_files
    return [f for v in values for f in local_data_files(v)]


def _where(data: bytes, pos: int) -> str:
    line = data.count(b"\n", 0, pos) + 1
    column = pos - (data.rfind(b"\n", 0, pos) + 1) + 1
    return f"line {line}, column {column}, byte offset {pos}"


def _row_problem(row: Any, i: int, name: str, where: str) -> Optional[str]:
    if not isinstance(row, dict):
        return f"{name} row {i} ({where}) is a JSON {type(row).__name__}; expected an object {{column: value}}"
    return None


def _json_array_problem(data: bytes, text: str, name: str) -> Optional[str]:
    """Walks a JSON array one row at a time, so a syntax error is located in its row."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    i = 0

    def skip(p: int) -> int:
        while p < len(text) and text[p].isspace():
            p += 1
        return p

    def at(p: int) -> str:
        return _where(data, len(text[:p].encode()))

    pos = skip(pos)
    if pos < len(text) and text[pos] == "]":
        return f"{name} holds no rows ([]); expected a JSON array with at least one object"
    while pos < len(text):
        try:
            row, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return f"{name} row {i} ({at(e.pos)}): {e.msg}; expected a JSON array of objects"
        problem = _row_problem(row, i, name, at(pos))
        if problem:
            return problem
        pos = skip(end)
        if pos < len(text) and text[pos] == "]":
            rest = skip(pos + 1)
            if rest < len(text):
                return f"{name} ({at(rest)}): text after the closing ']'; expected one JSON array"
            return None
        if pos >= len(text) or text[pos] != ",":
            return f"{name} row {i} ({at(pos)}): expected ',' or ']' after the row"
        pos, i = skip(pos + 1), i + 1
    return f"{name} ({at(len(text))}): the array is not closed; expected ']' at the end"


def _json_lines_problem(data: bytes, text: str, name: str) -> Optional[str]:
    offset, row = 0, 0
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        start = offset
        offset += len(line.encode())
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            at = _where(data, start + len(line[:e.pos].encode()))
            return f"{name} row {row} ({at}): {e.msg}; expected one JSON object per line"
        problem = _row_problem(value, row, name, f"line {number}")
        if problem:
            return problem
        row += 1
    return None


def encoding_problem(path: str) -> Optional[str]:
    """Where a file stops being UTF-8 (one streaming read, in bounded memory), or None.

    Example:
        >>> encoding_problem("latin1.jsonl")
        "'latin1.jsonl' is not UTF-8 text: byte b'\\xe9' at line 2, column 9, byte offset 20; expected UTF-8 ..."
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0  # bytes read, and newlines among them
    last_newline = -1  # offset of the last newline read
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BLOCK), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                # e.object is the block after the bytes the decoder held back (a split character, no newline)
                start = offset + len(block) - len(e.object)
                head = e.object[:e.start]
                line_start = start + head.rindex(b"\n") + 1 if b"\n" in head else last_newline + 1
                line = newlines + head.count(b"\n") + 1
                return (f"{str(path)!r} is not UTF-8 text: byte {e.object[e.start:e.start + 1]!r} at line {line}, "
                        f"column {start + e.start - line_start + 1}, byte offset {start + e.start}; expected UTF-8 "
                        f"(re-encode the file, e.g. iconv -t UTF-8)")
            offset += len(block)
            newlines += block.count(b"\n")
            if b"\n" in block:
                last_newline = offset - len(block) + block.rindex(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return (f"{str(path)!r} is not UTF-8 text: it ends inside a character (after byte offset {offset - 1}); "
                    f"expected UTF-8 (re-encode the file, e.g. iconv -t UTF-8)")
    return None


def check_encoding(source: str, data_files: Any) -> None:
    """Raises ValueError naming the file, line and byte where a local text data file stops being UTF-8.

    Args:
        source (str): the HF loader (``json``, ``csv``, ``text``; other sources are not checked).
        data_files: the loader's ``data_files``.
    """
    if source not in TEXT_LOADERS:
        return
    for path in local_data_files(data_files):
        problem = encoding_problem(path) if os.path.isfile(path) else None
        if problem:
            raise ValueError(problem)


def data_file_problem(path: str, loader: str = "json") -> Optional[str]:
    """The first problem of a local data file, as a message naming it and the row / line / byte, or None.

    Checks that the file exists and is not empty, that it is UTF-8 (``json``, ``csv``, ``text``), and for
    ``json`` that it is a JSON array of objects or one JSON object per line (JSON lines), with at least
    one row.

    Args:
        path (str): the file.
        loader (str): the HF ``load_dataset`` loader it is read with (``source``).

    Returns:
        Optional[str]: e.g. ``"'x.json' is empty (0 bytes); expected ..."``, or None when nothing is found.

    Example:
        >>> data_file_problem("empty.json")
        "'empty.json' is empty (0 bytes); expected rows: a JSON array of objects or one JSON object per line"
    """
    name = repr(str(path))
    if not os.path.isfile(path):
        return f"{name} does not exist" if not os.path.exists(path) else None
    if loader not in TEXT_LOADERS:
        return None
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        what = "a JSON array of objects or one JSON object per line" if loader == "json" else f"{loader} rows"
        return f"{name} is empty ({len(data)} bytes); expected rows: {what}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return encoding_problem(path)
    if loader != "json":
        return None
    if text.lstrip().startswith("["):
        return _json_array_problem(data, text, name)
    try:
        if isinstance(json.loads(text), dict):
            return None  # one JSON object (rows under a ``field``): valid JSON, the loader's error stands
    except json.JSONDecodeError:
        pass
    return _json_lines_problem(data, text, name)


def data_files_problem(source: str, data_files: Any) -> Optional[str]:
    """:func:`data_file_problem` of the first local file of ``data_files`` that has one (None for a hub
    ``source``, or when every file looks right: the loader's own error then stands)."""
    if source not in TEXT_LOADERS:
        return None
    for path in local_data_files(data_files):
        problem = data_file_problem(path, source)
        if problem:
            return problem
    return None


__all__ = ["TEXT_LOADERS", "check_encoding", "data_file_problem", "data_files_problem", "encoding_problem",
           "local_data_files"]
