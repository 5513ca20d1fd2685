"""The command line of a Config dataclass: one --flag per field, helped by the field's comment,
errors in one line (exit 2), unknown flags with their closest match, and the limits check."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import json
import pathlib
import re
import tokenize
import typing
import warnings


class BoolFlag(argparse.BooleanOptionalAction):
    """--flag / --no-flag by position: argparse reads any "--no-" prefix as off (--no-document)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings:
            on_flag, _off_flag = self.option_strings
            setattr(namespace, self.dest, option_string == on_flag)


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


def field_comments(cls: type) -> dict[str, str]:
    """The `#` comment of each field in the source of `cls` and of its dataclass bases (a
    subclass's wins): the flags' help texts."""
    comments = {}
    dataclass_bases = [klass for klass in cls.__mro__ if dataclasses.is_dataclass(klass)]
    for klass in reversed(dataclass_bases):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # defined where no source file is kept
            continue
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            field_line = _FIELD_LINE_RE.match(token.line)
            if field_line:
                comments[field_line[1]] = token.string[1:].strip()
    return comments


def build_parser(cls: type, comments: dict[str, str], tiny: dict | None) -> ArgParser:
    """One --flag per field of `cls` (a bool: --flag / --no-flag), helped by its comment."""
    description = (cls.__doc__ or "").strip()
    if description.startswith(cls.__name__ + "("):  # the signature dataclass writes as __doc__
        description = None
    epilog = None
    if tiny:
        tiny_flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in tiny.items())
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
        help_text = f"{comments.get(field.name, '')} (default: {field.default!r})".strip()
        help_text = help_text.replace("%", "%%")  # argparse %-formats help texts
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=field.name, help=help_text, action=BoolFlag)
        else:
            parser.add_argument(flag, dest=field.name, help=help_text, type=kind,
                                metavar=kind.__name__.upper())
    return parser


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
