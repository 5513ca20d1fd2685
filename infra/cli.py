"""The command line of a Config dataclass: one --flag per field, helped by the field's comment,
errors in one line (exit 2), unknown flags with their closest match, the limits and ranges checks,
and the check of a hub model id (one request, no retries)."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import json
import math
import os
import pathlib
import re
import sys
import textwrap
import tokenize
import typing
import warnings

from infra.errors import InputError


class BoolFlag(argparse.Action):
    """A bool field's on/off pair, each flag by its own name: --wandb / --no-wandb, and for a field
    named no_x, --no-x (on) / --x (off), never --no-no-x."""

    def __init__(self, option_strings, dest, on_flag: str, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)
        self.on_flag = on_flag

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string == self.on_flag)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def bool_flags(name: str) -> tuple[str, str]:
    """(on flag, off flag) of a bool field."""
    flag = "--" + name.replace("_", "-")
    if name.startswith("no_"):
        return flag, "--" + flag[len("--no-"):]
    return flag, "--no-" + flag[2:]


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's exit code 2, one line instead of the usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# The flags that are sizes and limits, by name: zero or a negative number is never meant (a zero
# token limit, a zero batch), unless the Config lists the flag in ZERO_MEANS_OFF.
LIMIT_RE = re.compile(
    r"^(max_|min_)|(_tokens|_len|_size|_batch|_group|_steps|_samples|_votes|_runs|_workers|_chars"
    r"|_mb|_timeout|_per_step|_n|_limit|_every|_checkpoints|_docs)$"
    r"|^(steps|rounds|iterations|votes|references)$")
_FIELD_LINE_RE = re.compile(r"\s+(\w+)\s*:")  # "    name: type = default  # comment"
_INTERVAL_RE = re.compile(r"([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])")  # "(0, 1]"


def _class_comments(klass: type) -> dict[str, str]:
    """The `#` comment of each field written in the source of `klass` itself, with the comment
    lines right below it that start at the same column (its continuation)."""
    comments = {}
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):  # defined where no source file is kept
        return comments
    field = None  # the field whose comment may go on below it
    column = next_row = -1  # where that continuation would start
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        text = token.string[1:].strip()
        field_line = _FIELD_LINE_RE.match(token.line)
        if field_line:
            field, column, next_row = field_line[1], col, row + 1
            comments[field] = text
        elif field is not None and row == next_row and col == column:
            comments[field] += " " + text
            next_row += 1
    return comments


def field_comments(cls: type) -> dict[str, str]:
    """Each field's help text from the comments in the source of `cls` and its dataclass bases:
    what the flag does (the first class to declare it), then the source of the default that a
    subclass redeclares ("prompt + completion tokens...; a 5,992-token document + ...")."""
    comments = {}
    dataclass_bases = [klass for klass in cls.__mro__ if dataclasses.is_dataclass(klass)]
    for klass in reversed(dataclass_bases):
        for name, comment in _class_comments(klass).items():
            meaning = comments.get(name, "")
            if meaning and comment != meaning and not comment.startswith(meaning):
                comment = f"{meaning}; {comment}"
            comments[name] = comment
    return comments


def build_parser(cls: type, comments: dict[str, str], tiny: dict | None,
                 about: str = "") -> ArgParser:
    """One --flag per field of `cls` (a bool: an on/off pair), helped by its comment; `about`
    (else the docstring of `cls`) opens the help."""
    description = (cls.__doc__ or "").strip()
    if description.startswith(cls.__name__ + "("):  # the signature dataclass writes as __doc__
        description = None
    if about:
        description = about
    epilog = None
    if tiny:
        tiny_flags = " ".join(as_flags(tiny))
        epilog = ("--model tiny (the built-in random test model) switches the defaults to a smoke "
                  "profile, about a minute on 2 CPU cores; a flag you give still wins:\n  "
                  + tiny_flags)
    parser = ArgParser(description=description, epilog=epilog, allow_abbrev=False,
                       argument_default=argparse.SUPPRESS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):  # a default_factory field is no bool/int/float/str
        kind = hints.get(field.name, str)
        if kind not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{field.name}: a field is bool/int/float/str, not "
                            f"{kind}")
        default = repr(field.default)
        if kind is bool:
            on_flag, off_flag = bool_flags(field.name)
            default = on_flag if field.default else off_flag
        help_text = f"{comments.get(field.name, '')} (default: {default})".strip()
        help_text = help_text.replace("%", "%%")  # argparse %-formats help texts
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(on_flag, off_flag, dest=field.name, help=help_text,
                                action=BoolFlag, on_flag=on_flag)
        else:
            parser.add_argument(flag, dest=field.name, help=help_text, type=kind,
                                metavar=kind.__name__.upper())
    return parser


def program_name(cls: type) -> str:
    """The script's file name: "spice.py" (run as `python spice.py`, its module is __main__)."""
    if cls.__module__ != "__main__":
        return cls.__module__.rsplit(".", 1)[-1] + ".py"
    return os.path.basename(sys.argv[0])


def about_line(cls: type, prog: str) -> str:
    """--help's opening sentence: what the script runs, from its module docstring's first
    paragraph (the method and its paper)."""
    doc = sys.modules[cls.__module__].__doc__ or ""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if not paragraph:
        return ""
    return textwrap.fill(f"{prog} trains a model with {paragraph}", width=79)


def as_flags(values: dict) -> list[str]:
    """{"max_tokens": 24, "data": "/abs/tests/data/x.jsonl"} -> ["--max-tokens 24",
    "--data tests/data/x.jsonl"]: the flags that give these values (paths relative to here)."""
    flags = []
    for name, value in values.items():
        if isinstance(value, str) and os.path.isabs(value):
            value = os.path.relpath(value)
        flags.append(f"--{name.replace('_', '-')} {value}")
    return flags


def smoke_profile_line(cfg, tiny: dict | None) -> str:
    """The smoke profile's values a --model tiny run keeps (a flag given wins), as the flags that
    would give them; "" where no profile applies."""
    if not tiny or cfg.model != "tiny" or cfg.resume:
        return ""
    kept = {}
    for name, value in tiny.items():
        if getattr(cfg, name) == value:
            kept[name] = value
    if not kept:
        return ""
    return "smoke profile of --model tiny (a flag you give wins): " + " ".join(as_flags(kept))


def unknown_arguments_error(parser: ArgParser, unknown: list[str]) -> str:
    """One message for all arguments the parser did not know, each flag with its closest match."""
    flags = [option for option in parser._option_string_actions if option.startswith("--")]
    messages = []
    for argument in unknown:
        name = argument.split("=", 1)[0]
        if not name.startswith("-"):
            messages.append(f"unexpected argument {argument!r} (flags look like --name VALUE)")
            continue
        closest = difflib.get_close_matches(name.replace("_", "-"), flags, n=1, cutoff=0.5)
        if closest:
            messages.append(f"unknown flag {name}; did you mean {closest[0]}?")
        else:
            messages.append(f"unknown flag {name}; see --help for the list")
    return "; ".join(messages)


def saved_config(cls: type, parser: ArgParser, run_dir: str) -> dict:
    """The fields of `cls` in the config.json of the run folder --resume names (its output_dir that
    folder); other keys are ignored with a warning."""
    config_path = pathlib.Path(run_dir) / "config.json"
    if not config_path.is_file():
        parser.error(f"--resume {run_dir}: no config.json there (expected a run folder "
                     "written by Run)")
    saved = json.loads(config_path.read_text())
    field_names = {field.name for field in dataclasses.fields(cls)}
    unknown_keys = sorted(set(saved) - field_names)
    if unknown_keys:
        warnings.warn(f"--resume: ignoring saved config keys not in {cls.__name__}: "
                      f"{unknown_keys}")
    values = {}
    for name, value in saved.items():
        if name in field_names:
            values[name] = value
    values["output_dir"] = str(run_dir)
    return values


def zero_means_off(cls: type) -> set[str]:
    """The flags for which 0 means "off": ZERO_MEANS_OFF of `cls` and of every class above it."""
    names = set()
    for klass in cls.__mro__:
        names.update(vars(klass).get("ZERO_MEANS_OFF", ()))
    return names


def check_limits(cls: type, parser: ArgParser, given: dict, comments: dict[str, str]) -> None:
    """A size or limit given on the command line (a flag LIMIT_RE names) must be positive; 0 only
    where `cls` declares that it means off (ZERO_MEANS_OFF)."""
    zero_ok = zero_means_off(cls)
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}
    for name, value in given.items():
        if type(value) not in (int, float) or value > 0 or not LIMIT_RE.search(name):
            continue
        if value == 0 and name in zero_ok:
            continue
        default = defaults.get(name)
        hint = f"the default is {default!r}"
        if default == 0:
            hint = f"leave the flag out for the default ({comments.get(name, '')})"
        parser.error(f"--{name.replace('_', '-')} {value}: must be a positive number; {hint}")


def declared_ranges(cls: type) -> dict[str, str]:
    """The interval of each number flag, from RANGES of `cls` and of every class above it."""
    found = {}
    for klass in reversed(cls.__mro__):
        found.update(vars(klass).get("RANGES", {}))
    return found


def _interval(text: str) -> tuple[str, float, float, str]:
    """"(0, 1]" -> ("(", 0.0, 1.0, "]")."""
    match = _INTERVAL_RE.fullmatch(text.strip())
    if match is None:
        raise TypeError(f"RANGES: {text!r} is no interval such as (0, 1] or [0, inf)")
    opening, low, high, closing = match.groups()
    return opening, float(low), float(high), closing


def in_range(value, text: str) -> bool:
    """Whether `value` lies in the interval `text` ("[0, 1)"; NaN lies in none)."""
    opening, low, high, closing = _interval(text)
    above = value > low or (opening == "[" and value == low)
    below = value < high or (closing == "]" and value == high)
    return above and below


_LOW_BOUND = {"[": ">=", "(": ">"}
_HIGH_BOUND = {"]": "<=", ")": "<"}


def range_words(text: str) -> str:
    """"(0, 1]" -> "> 0 and <= 1"; "[0, inf)" -> ">= 0"; "(-inf, inf)" -> "a finite number"."""
    opening, low, high, closing = _interval(text)
    words = []
    if math.isfinite(low):
        words.append(f"{_LOW_BOUND[opening]} {low:g}")
    if math.isfinite(high):
        words.append(f"{_HIGH_BOUND[closing]} {high:g}")
    return " and ".join(words) or "a finite number"


def check_ranges(cls: type, parser: ArgParser, cfg) -> None:
    """Every number field of `cfg` in the interval RANGES of its Config declares (by default any
    finite number), however it got there: a flag, the smoke profile or a --resume config."""
    ranges = declared_ranges(cls)
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}
    for name in ranges:
        if name not in defaults:
            raise TypeError(f"{cls.__name__}.RANGES names {name!r}, which is no field")
    for name, default in defaults.items():
        value = getattr(cfg, name)
        if type(value) not in (int, float):
            continue
        interval = ranges.get(name, "(-inf, inf)")
        if in_range(value, interval):
            continue
        parser.error(f"--{name.replace('_', '-')} {value}: must be {range_words(interval)}; the "
                     f"default is {default!r}")


# ------------------------------------------------------------------------ a model on the hub
HUB_TIMEOUT_S = 10  # the one request that checks a hub id; its client does not retry it


def check_hub_model(name: str, flag: str, fix: str) -> str:
    """A hub id, checked before anything loads: in the local cache, or known to the hub (one
    request, no retries). A cached id while the hub cannot be reached turns on offline mode, so
    that the loaders read the cache instead of retrying: the line that says so, else "".
    Anything else is an InputError naming the fix."""
    from huggingface_hub import constants, try_to_load_from_cache
    cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return ""
        raise InputError(f"{flag} {name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE "
                         "is set, so it cannot be downloaded; download it once online "
                         f"(hf download {name}), or pass a local folder or 'tiny'")
    from huggingface_hub import HfApi, errors
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
        return ""
    except errors.GatedRepoError:  # a RepositoryNotFoundError too: first
        problem = (f"a gated model (accept its terms on https://huggingface.co/{name}, then "
                   "log in with hf auth login)")
    except errors.RepositoryNotFoundError:
        problem = ("no such model on the Hugging Face Hub (a typo? a private one needs hf auth "
                   "login)")
    except Exception as e:  # no network, a proxy, a hub outage: whatever it is, the hub cannot say
        problem = f"the Hugging Face Hub cannot be reached ({type(e).__name__})"
    if cached:
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True  # read at each call by huggingface_hub, transformers, vLLM
        return f"{flag} {name}: {problem}; using its copy in the local cache (HF_HUB_OFFLINE=1)"
    raise InputError(f"{flag} {name}: {problem}, and it is not in the local cache; {fix}")
