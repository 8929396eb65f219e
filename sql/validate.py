"""Input checks shared by the CLI, the API and the transitions: one clear message each."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from .errors import InvalidInput
from .settings import MAX_LEASE_SECONDS

# Every state a job can be in (DESIGN.md, "Entities and states"; the jobs.state CHECK).
JOB_STATES = ("blocked", "queued", "running", "uncertain", "succeeded", "failed", "cancelled",
              "superseded")

MAX_ARG_CHARS = 16384
MAX_COMMAND_CHARS = 65536
MAX_BATCH_LIMIT = 1000  # what pgd_claim_batch and pgd_complete_batch accept


def check_text(kind: str, value: Any, *, max_len: int) -> str:
    """A non-empty string of at most ``max_len`` characters without NUL; else InvalidInput."""
    if not isinstance(value, str):
        raise InvalidInput(f"{kind} must be text")
    if value == "":
        raise InvalidInput(f"{kind} must not be empty")
    if "\x00" in value:
        raise InvalidInput(f"{kind} must not contain NUL bytes")
    if len(value) > max_len:
        raise InvalidInput(f"{kind} is longer than {max_len} characters")
    _check_encodable(kind, value)
    return value


def _check_encodable(kind: str, value: str) -> None:
    # lone surrogates ("\ud800" in JSON, undecodable bytes on a command line) are not UTF-8
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{kind} must be valid UTF-8 text") from None


def check_int(kind: str, value: Any, low: int, high: int, *, strict: bool = False) -> int:
    """An integer in [low, high]; else InvalidInput. Unless ``strict``, integral text (ASCII
    digits with an optional sign: not "1_000", not other scripts' digits, which int() takes)
    and whole floats are accepted too (form fields); strict is for typed input (JSON, TOML)."""
    if isinstance(value, bool) or (strict and not isinstance(value, int)):
        raise InvalidInput(f"{kind} must be a whole number, got {_shown(value)}")
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in ("+", "-") else text
        if not (digits.isascii() and digits.isdigit()):
            raise InvalidInput(f"{kind} must be a whole number, got {_shown(value)}")
        value = int(text, 10)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise InvalidInput(f"{kind} must be a whole number, got {_shown(value)}")
    if not low <= value <= high:
        raise InvalidInput(f"{kind} must be between {low} and {high}, got {value}")
    return value


def _shown(value: Any) -> str:
    """A rejected value as the request spelled it, for an error message: JSON's true, false
    and null; text quoted and cut at 40 characters; a list or an object by its kind."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value if len(value) <= 40 else value[:40] + "…", ensure_ascii=False)
    if isinstance(value, (int, float)):
        return repr(value)
    return {list: "a list", tuple: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _plain(number: float) -> str:
    """A number as people write it: 2592000.0 -> "2592000", 0.25 -> "0.25" (an exponent only
    past 12 digits)."""
    return format(number, ".12g")


def check_number(kind: str, value: Any, low: float, high: float) -> float:
    """A finite number (or numeric text) in [low, high]; else InvalidInput."""
    if isinstance(value, bool):
        raise InvalidInput(f"{kind} must be a number, got {_shown(value)}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise InvalidInput(f"{kind} must be a number, got {_shown(value)}") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(f"{kind} must be a finite number, got {_shown(value)}")
    if not low <= value <= high:
        raise InvalidInput(f"{kind} must be between {_plain(low)} and {_plain(high)}, got {_plain(value)}")
    return float(value)


def check_command(command: Any) -> list[str]:
    """A command as an argument list: 1–256 non-empty-program strings, no NUL, 64 KiB total."""
    if isinstance(command, str) or not isinstance(command, Sequence):
        raise InvalidInput("command must be a list of arguments")
    args = list(command)
    if not args:
        raise InvalidInput("command must not be empty")
    if len(args) > 256:
        raise InvalidInput("command has more than 256 arguments")
    for arg in args:
        if not isinstance(arg, str):
            raise InvalidInput("every command argument must be text")
        if "\x00" in arg:
            raise InvalidInput("command arguments must not contain NUL bytes")
        if len(arg) > MAX_ARG_CHARS:
            raise InvalidInput(f"a command argument is longer than {MAX_ARG_CHARS} characters")
        _check_encodable("command argument", arg)
    if args[0].strip() == "":
        raise InvalidInput("command must start with a program name")
    if sum(len(a) for a in args) > MAX_COMMAND_CHARS:
        raise InvalidInput(f"command is longer than {MAX_COMMAND_CHARS} characters")
    return args


def check_max_batch(max_batch: Any) -> int:
    """``max_batch`` (most jobs claimed, or outcomes reported, in one transaction) if it is an
    int in 1..MAX_BATCH_LIMIT.

    Raises:
        InvalidInput: otherwise (a bool or integral text is refused too: it is typed input).
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) \
            or not 1 <= max_batch <= MAX_BATCH_LIMIT:
        raise InvalidInput(f"max batch must be an integer from 1 to {MAX_BATCH_LIMIT}, "
                           f"got {max_batch!r}")
    return max_batch


def check_lease_seconds(lease_seconds: Any) -> float:
    """A lease in seconds, more than 0 and at most MAX_LEASE_SECONDS (what a claim accepts,
    pgd_runner_pools in sql/functions/claim.sql), as a float.

    Raises:
        InvalidInput: otherwise (NaN, infinities, a bool, text). A lease is added to the
            database's now: unbounded, it could end past what Python can load (year 9999)
            or PostgreSQL can hold, and a lease that never lapses is never expired.
    """
    if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) \
            or not 0 < lease_seconds <= MAX_LEASE_SECONDS:  # NaN fails both comparisons
        raise InvalidInput(f"lease seconds must be in (0, {MAX_LEASE_SECONDS:g}], "
                           f"got {_shown(lease_seconds)}")
    return float(lease_seconds)
