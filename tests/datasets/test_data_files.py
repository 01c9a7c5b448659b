"""A broken local data file is named with the row, line or byte where it breaks, for SFT (alpaca_dataset)
and GRPO (prompt_dataset) alike. HF datasets used to say "An error occurred while generating the
dataset" (malformed JSON, non-UTF-8 bytes), raise a bare StopIteration (an empty file) or
'Instruction "train" corresponds to no data!' ([]); a whitespace-only answer used to train."""

import json
import re

import pytest

from logitless.datasets import alpaca_dataset, tiny_qwen2_5_tokenizer
from logitless.rl.prompts import prompt_dataset

ROW = {"instruction": "Add the numbers.", "input": "2, 3", "output": "5"}
PROMPT = {"prompt": "1+1=", "answer": "2"}


@pytest.fixture(scope="module")
def tok():
    return tiny_qwen2_5_tokenizer(max_seq_len=64)


def _bad_files(row):
    """name -> (file bytes, what the message must say) for a file of rows like ``row``."""
    good = json.dumps(row)
    lines = (good + "\n").encode()
    broken = good[:-1] + ', "x": }'  # a value missing in the second row
    return {
        "array_syntax.json": ("[" + good + ",\n " + broken + "]").encode(),
        "lines_syntax.jsonl": lines + (broken + "\n").encode(),
        "not_utf8.json": lines + good[:-1].encode() + b', "x": "caf\xe9"}\n',
        "empty.json": b"",
        "blank.jsonl": b"\n  \n",
        "no_rows.json": b"[]",
        "row_not_object.jsonl": lines + b"[1, 2]\n",
    }, len(lines)


def _expected(name, path, offset):
    path = re.escape(str(path))
    return {
        "array_syntax.json": rf"'{path}' row 1 \(line 2, column {len(json.dumps(ROW)) + 8}, byte offset \d+\): "
                             rf"Expecting value; expected a JSON array of objects",
        "lines_syntax.jsonl": rf"'{path}' row 1 \(line 2, column \d+, byte offset \d+\): Expecting value; expected one "
                              rf"JSON object per line",
        "not_utf8.json": rf"'{path}' is not UTF-8 text: byte b'\\xe9' at line 2, column \d+, byte offset \d+; "
                         rf"expected UTF-8",
        "empty.json": rf"'{path}' is empty \(0 bytes\); expected rows: a JSON array of objects or one JSON object "
                      rf"per line",
        "blank.jsonl": rf"'{path}' is empty \(4 bytes\)",
        "no_rows.json": rf"'{path}' holds no rows \(\[\]\); expected a JSON array with at least one object",
        "row_not_object.jsonl": rf"'{path}' row 1 \(line 2\) is a JSON list; expected an object",
    }[name]


@pytest.mark.parametrize("name", sorted(_bad_files(ROW)[0]))
def test_sft_data_file_errors_name_the_file_and_the_row(tmp_path, tok, name):
    files, offset = _bad_files(ROW)
    path = tmp_path / name
    path.write_bytes(files[name])
    with pytest.raises(ValueError, match=_expected(name, path, offset)):
        alpaca_dataset(tok, source="json", data_files=str(path))


@pytest.mark.parametrize("name", sorted(_bad_files(PROMPT)[0]))
def test_grpo_data_file_errors_name_the_file_and_the_row(tmp_path, tok, name):
    files, offset = _bad_files(PROMPT)
    path = tmp_path / name
    path.write_bytes(files[name])
    expected = _expected(name, path, offset).replace(str(len(json.dumps(ROW)) + 8), r"\d+")
    with pytest.raises(ValueError, match=expected):
        prompt_dataset(tok, data_files=str(path))


def _first_bad(data):
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start


def test_the_byte_offset_is_where_the_bad_byte_is(tmp_path, monkeypatch):
    from logitless.datasets import _files as files
    from logitless.datasets._files import data_file_problem

    data = b'{"a": "ok"}\n{"a": "caf\xe9"}\n'
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    bad, line_start = data.index(b"\xe9"), data.index(b"\n") + 1
    assert data_file_problem(str(path)) == (
        f"{str(path)!r} is not UTF-8 text: byte b'\\xe9' at line 2, column {bad - line_start + 1}, byte offset {bad}; "
        f"expected UTF-8 (re-encode the file, e.g. iconv -t UTF-8)")
    # read 3 bytes at a time, a bad byte at every position (also inside a split character) is placed
    # where a whole-file decode places it
    monkeypatch.setattr(files, "READ_BLOCK", 3)
    utf8 = data.replace(b"\xe9", "é".encode())
    for at in range(len(utf8)):
        broken = utf8[:at] + b"\xff" + utf8[at + 1:]
        path.write_bytes(broken)
        assert f" at {files._where(broken, _first_bad(broken))};" in files.encoding_problem(str(path))
    good = tmp_path / "good.json"
    good.write_text(json.dumps([ROW, ROW]))
    assert data_file_problem(str(good)) is None


@pytest.mark.parametrize("output", ["   ", "\n\t"])
def test_a_whitespace_only_sft_answer_is_an_error(tmp_path, tok, output):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([ROW, {**ROW, "output": output}]))
    with pytest.raises(ValueError, match=re.escape(f"alpaca dataset '{path}': row 1 has field 'output' = {output!r}; "
                                                   f"expected a non-empty string (not whitespace only)")):
        alpaca_dataset(tok, source="json", data_files=str(path))
