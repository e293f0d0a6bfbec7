"""Reading chat datasets: JSONL in OpenAI `messages` or ShareGPT `conversations` format.

Every line becomes a `Sample` whose messages are normalised to `{"role", "content"}` with
roles system | user | assistant, or a `BadLine` naming the file, the line number and the
reason. Nothing is dropped silently: with on_bad_line="skip" the bad lines are counted and
the first ones kept with their reasons in a `ParseReport`; with "stop" the first one raises.

Lines are read one at a time with a byte cap (MAX_LINE_BYTES): a longer line is never held in
memory (the rest of it is skipped in small reads, only counted) and stops the read with a
LineTooLongError naming the file, the line, its size and the cap, whatever on_bad_line says: a
line that long is a broken file (a JSON array, lost line breaks) or a sample whose tokenisation
alone would need gigabytes, and skipping it could silently drop most of a file.

Format detection ("auto") looks at the first line that is a JSON object with one of the two
keys; a later line in the other format is an error naming both lines (a file made by
concatenating two datasets should be converted, not guessed at line by line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from engine.system.disk import fmt_bytes
from engine.io.names import is_safe_name
from engine.errors import EngineError

FORMATS = ("auto", "messages", "sharegpt")
POLICIES = ("skip", "stop")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
FORMAT_KEY = {"messages": "messages", "sharegpt": "conversations"}
FORMAT_TITLE = {"messages": "OpenAI messages", "sharegpt": "ShareGPT conversations"}
KEEP_BAD_LINES = 20  # reasons kept verbatim; the rest are counted
# Bytes per line, newline excluded. Tokenising costs up to ~200 bytes of memory per byte of text
# (the fast tokenizer's encoding and offsets, the id lists; measured with a byte-level BPE), so
# 2 MiB bounds one sample at about half a GB while leaving room for conversations of ~500K
# tokens, far past any max_seq_len a drafter trains on (a sample is cut to it anyway).
MAX_LINE_BYTES = 2 << 20
_SKIP_CHUNK = 1 << 20  # reads through an over-long line


class DatasetError(EngineError):
    """The dataset cannot be read as a whole (missing file, mixed formats, stop on a bad line)."""


@dataclass(frozen=True)
class BadLine:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "reason": self.reason}


def _size_text(n: int) -> str:
    return fmt_bytes(n) if n < 1024 else f"{fmt_bytes(n)} ({n:,} bytes)"


class LineTooLongError(DatasetError):
    """A line longer than MAX_LINE_BYTES: the read stops (it is not skipped as a bad line)."""

    def __init__(self, file: str, line: int, size: int, cap: int, file_size: int | None = None):
        whole = line == 1 and file_size is not None and size >= 0.9 * file_size
        hint = (" The line is almost the whole file: is it one JSON document rather than JSONL "
                "(one conversation per line)? Convert it." if whole else "")
        self.file, self.line, self.size, self.cap = file, line, size, cap
        self.evidence = (f"{file}:{line}: line {line} is {_size_text(size)}, over the {_size_text(cap)} "
                         f"per-line cap of the dataset reader.{hint}")
        self.fix = (f"shorten or remove line {line} of {file}: a sample is cut to dataset.max_seq_len tokens "
                    "anyway, and tokenising one this long would take ~200 times its size in memory")
        super().__init__(f"{self.evidence} Fix: {self.fix}")


class BadLineError(DatasetError):
    """on_bad_line = "stop" and a malformed line was found."""

    def __init__(self, bad: BadLine):
        super().__init__(f"{bad} (dataset.on_bad_line is 'stop': fix the line, or set it to 'skip' to count and skip it)")
        self.bad = bad


@dataclass(frozen=True)
class Sample:
    index: int  # 0-based position among the valid samples of the file
    id: str  # safe as a file name
    messages: list[dict[str, str]]
    line: int = 0  # 1-based line number in the file


@dataclass
class ParseReport:
    """What reading a file found besides the samples."""

    file: str
    format: str = ""  # detected or configured: messages | sharegpt
    samples: int = 0
    bad_count: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)  # the first KEEP_BAD_LINES
    derived_ids: dict[str, int] = field(default_factory=dict)  # reason -> count (missing, unsafe, duplicate)

    def add_bad(self, bad: BadLine) -> None:
        self.bad_count += 1
        if len(self.bad_lines) < KEEP_BAD_LINES:
            self.bad_lines.append(bad)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "format": self.format, "samples": self.samples,
                "bad_count": self.bad_count, "bad_lines": [b.to_dict() for b in self.bad_lines],
                "derived_ids": dict(self.derived_ids)}


class _LineError(Exception):
    """Why one line is malformed (becomes a BadLine)."""


def _describe(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts that are all text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _LineError(f"{where}.content[{j}] is not a text part "
                                 "(only text content is supported: {\"type\": \"text\", \"text\": ...})")
            texts.append(part["text"])
        return "".join(texts)
    raise _LineError(f"{where}.content is {_describe(content)}, expected a string")


def _normalise(turns: Any, fmt: str) -> list[dict[str, str]]:
    key = FORMAT_KEY[fmt]
    if not isinstance(turns, list):
        raise _LineError(f"'{key}' is {_describe(turns)}, expected a list of turns")
    if not turns:
        raise _LineError(f"'{key}' is empty: a conversation needs at least one user and one assistant turn")
    role_key, text_key = ("role", "content") if fmt == "messages" else ("from", "value")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise _LineError(f"{where} is {_describe(turn)}, expected an object with '{role_key}' and '{text_key}'")
        for needed in (role_key, text_key):
            if needed not in turn:
                raise _LineError(f"{where} has no '{needed}' key")
        raw_role = turn[role_key]
        if not isinstance(raw_role, str):
            raise _LineError(f"{where}.{role_key} is {_describe(raw_role)}, expected a string")
        if fmt == "messages":
            if raw_role not in ROLES:
                raise _LineError(f"{where}.role {raw_role!r} is unknown: use one of {', '.join(ROLES)}")
            role = raw_role
            content = _content_text(turn[text_key], where)
        else:
            role = SHAREGPT_ROLES.get(raw_role, "")
            if not role:
                raise _LineError(f"{where}.from {raw_role!r} is unknown: use one of {', '.join(SHAREGPT_ROLES)}")
            content = turn[text_key]
            if not isinstance(content, str):
                raise _LineError(f"{where}.value is {_describe(content)}, expected a string")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise _LineError("no assistant turn: nothing to train on")
    return messages


def _line_format(obj: dict[str, Any]) -> str | None:
    has = [fmt for fmt, key in FORMAT_KEY.items() if key in obj]
    return has[0] if len(has) == 1 else None


class DatasetReader:
    """Iterate the samples of one JSONL file; `report` fills in as it goes.

    `for sample in DatasetReader(path, "auto", "skip"): ...` then `reader.report`.
    """

    def __init__(self, path: Path | str, format: str = "auto", on_bad_line: str = "skip"):
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        if on_bad_line not in POLICIES:
            raise ValueError(f"on_bad_line must be one of {POLICIES}, got {on_bad_line!r}")
        self.path = Path(path)
        self.format = format
        self.on_bad_line = on_bad_line
        self.report = ParseReport(file=str(self.path), format="" if format == "auto" else format)
        self._detected_at = 0

    @property
    def bad_lines(self) -> list[BadLine]:
        """The first KEEP_BAD_LINES bad lines (all of them are counted in bad_count)."""
        return self.report.bad_lines

    @property
    def bad_count(self) -> int:
        return self.report.bad_count

    def _bad(self, line: int, reason: str) -> None:
        bad = BadLine(str(self.path), line, reason)
        if self.on_bad_line == "stop":
            raise BadLineError(bad)
        self.report.add_bad(bad)

    def _pick_format(self, obj: dict[str, Any], number: int) -> str:
        if self.format != "auto":
            return self.format
        line_fmt = _line_format(obj)
        if not self.report.format:
            if line_fmt is None:
                raise _LineError("has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT), or has both")
            self.report.format, self._detected_at = line_fmt, number
            return line_fmt
        if line_fmt is not None and line_fmt != self.report.format:
            raise DatasetError(
                f"{self.path}:{number}: this line is in {FORMAT_TITLE[line_fmt]} format but the file is "
                f"{FORMAT_TITLE[self.report.format]} (detected at line {self._detected_at}). "
                "Convert the file to one format, or set dataset.format to say which one to expect")
        return self.report.format

    def _parse(self, text: str, number: int) -> tuple[str | None, list[dict[str, str]]]:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise _LineError(f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise _LineError(f"is {_describe(obj)}, expected a JSON object")
        fmt = self._pick_format(obj, number)
        key = FORMAT_KEY[fmt]
        if key not in obj:
            other = "conversations" if key == "messages" else "messages"
            hint = f" (it has '{other}': set dataset.format to match)" if other in obj else ""
            raise _LineError(f"missing key '{key}' for {FORMAT_TITLE[fmt]} format{hint}")
        raw_id = obj.get("id")
        sample_id = raw_id if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
        return (None if sample_id is None else str(sample_id)), _normalise(obj[key], fmt)

    def __iter__(self) -> Iterator[Sample]:
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            raise DatasetError(f"{self.path} does not exist: check dataset.path") from None
        except OSError as exc:
            raise DatasetError(f"{self.path} cannot be read ({exc.strerror}): check its permissions") from None
        seen: set[str] = set()
        index = 0
        with handle:
            for number, raw in self._lines(handle):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    self._bad(number, f"not UTF-8 ({exc.reason} at byte {exc.start})")
                    continue
                del raw
                if not text.strip():
                    continue  # blank lines (e.g. a trailing one) are not samples
                try:
                    given_id, messages = self._parse(text, number)
                except _LineError as exc:
                    self._bad(number, str(exc))
                    continue
                sample_id = self._safe_id(given_id, index, number, seen)
                seen.add(sample_id)
                self.report.samples += 1
                yield Sample(index=index, id=sample_id, messages=messages, line=number)
                index += 1

    def _lines(self, handle) -> Iterator[tuple[int, bytes]]:
        """(line number, bytes) per line; never reads more than MAX_LINE_BYTES + 2 bytes of one line."""
        cap = MAX_LINE_BYTES
        number = 0
        while True:
            raw = handle.readline(cap + 2)  # room for "\r\n" after a line of exactly `cap` bytes
            if not raw:
                return
            number += 1
            complete = raw.endswith(b"\n")
            size = len(raw.rstrip(b"\r\n")) if complete else len(raw)
            if size > cap:
                while not complete:  # count the rest of the line without keeping it
                    chunk = handle.readline(_SKIP_CHUNK)
                    if not chunk:
                        break
                    complete = chunk.endswith(b"\n")
                    size += len(chunk.rstrip(b"\r\n")) if complete else len(chunk)
                del raw
                try:
                    file_size = os.fstat(handle.fileno()).st_size
                except OSError:
                    file_size = None
                raise LineTooLongError(str(self.path), number, size, cap, file_size)
            yield number, raw

    def _safe_id(self, given: str | None, index: int, number: int, seen: set[str]) -> str:
        """The line's id if it is a safe, unused file name; else derived `s<index:07d>`."""
        if given is not None and is_safe_name(given) and given not in seen:
            return given
        reason = "missing" if given is None else ("unsafe" if not is_safe_name(given) else "duplicate")
        self.report.derived_ids[reason] = self.report.derived_ids.get(reason, 0) + 1
        derived = f"s{index:07d}"
        if derived in seen:  # a user id already took it: the line number makes it unique
            derived = f"s{index:07d}-l{number}"
        return derived


def iter_samples(path: Path | str, format: str = "auto", on_bad_line: str = "skip",
                 report: ParseReport | None = None) -> DatasetReader:
    """The valid samples of `path`, as an iterable reader (iterate it once).

    Bad lines go to `reader.report` (or the `report` given); `reader.bad_count` counts them all.
    Iterating raises DatasetError for a missing/unreadable file or mixed formats, and
    BadLineError on the first bad line when on_bad_line is "stop".
    """
    reader = DatasetReader(path, format, on_bad_line)
    if report is not None:
        report.file = str(reader.path)
        report.format = reader.report.format
        reader.report = report
    return reader
