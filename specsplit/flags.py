"""Command-line flags declared once, on a config dataclass.

A field declared as `name: int = flag(8, "--max-sequences", "preallocated KV slots")` carries
its flag, help, environment variable and choices in its metadata. `add_flags` builds argparse
from those fields, `from_args` builds the config from the parsed namespace, and `to_argv`
renders a config back into flags (what the launcher passes to the services it starts).

Field types: str, int, float; `str | None` (an empty value is None); `list[int] | None` (a
comma-separated list, empty: None); bool, a switch whose flag turns the default around
(`--compile` sets a False default, `--no-cuda-graphs` or `--inline-steps` clear a True one).
An environment variable gives the default of its flag. A secret is read from the file its
flag names, or from its environment variable (the value itself), and is never rendered: it
travels in the environment, out of sight of `ps`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")
C = TypeVar("C")

KEY = "specsplit.flag"  # the metadata key of a field's Flag


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str  # e.g. --max-context
    help: str
    env: str | None = None  # the default comes from this variable when it is set
    choices: tuple[str, ...] | None = None
    secret: bool = False


def flag(default: T, name: str, help: str, *, env: str | None = None, choices: Sequence[str] | None = None,
         secret: bool = False) -> T:
    """A dataclass field (default `default`) set by the command-line flag `name`."""
    meta = {KEY: Flag(name, help, env, tuple(choices) if choices is not None else None, secret)}
    return cast(T, dataclasses.field(default=default, metadata=meta))


def flag_of(field: dataclasses.Field[Any]) -> Flag | None:
    return field.metadata.get(KEY)


def int_list(text: str) -> list[int] | None:
    """'1,2,3' -> [1, 2, 3]; '' -> None."""
    return [int(x) for x in text.split(",")] if text else None


def optional_str(text: str) -> str | None:
    return text or None


def read_secret(path: str) -> str:
    """A secret kept in a file: its text without surrounding whitespace, never empty."""
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"{path} is empty")
    return text


class _ReadSecret(argparse.Action):
    """The flag names a file; the namespace gets its content. An empty name keeps the default."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values:
            setattr(namespace, self.dest, read_secret(values))


def _text_parser(tp: Any) -> Callable[[str], Any] | None:
    """How a flag's text becomes a value of type `tp`; None for a switch (bool)."""
    if tp is bool:
        return None
    if tp in (str, int, float):
        return cast(Callable[[str], Any], tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and args[0] is str:
            return optional_str
        if len(args) == 1 and typing.get_origin(args[0]) is list and typing.get_args(args[0]) == (int,):
            return int_list
    raise TypeError(f"no flag type for {tp!r}")


def _render(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def _flagged(cls: type, only: Iterable[str] | None) -> list[tuple[dataclasses.Field[Any], Flag, Any]]:
    """(field, flag, type) of the flagged fields of `cls`, all or those named in `only`."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields) if only is None else list(only)
    out = []
    for name in names:
        if name not in fields:
            raise ValueError(f"{cls.__name__} has no field {name!r}")
        spec = flag_of(fields[name])
        if spec is not None:
            out.append((fields[name], spec, hints[name]))
        elif only is not None:
            raise ValueError(f"{cls.__name__}.{name} has no flag")
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, *,
              only: Iterable[str] | None = None, names: Mapping[str, str] | None = None, prefix: str = "",
              label: str = "", environment: bool = True) -> None:
    """One flag per flagged field of `cls` (or of those named in `only`), stored under the
    field's name after `prefix`; `names` renames flags by field, `label` starts their help;
    without `environment`, no default comes from an environment variable."""
    for f, spec, tp in _flagged(cls, only):
        name, dest = (names or {}).get(f.name, spec.name), prefix + f.name
        env = os.environ.get(spec.env) if environment and spec.env else None
        help = f"{label}: {spec.help}" if label else spec.help
        if environment and spec.env:
            help = f"{help} (env {spec.env}{', the value itself' if spec.secret else ''})"
        parse = _text_parser(tp)
        if parse is None:
            parser.add_argument(name, dest=dest, action="store_false" if f.default else "store_true", help=help)
        elif spec.secret:
            parser.add_argument(name, dest=dest, action=_ReadSecret, default=env or None, metavar="FILE", help=help)
        else:
            default = f.default if env is None else parse(env)
            parser.add_argument(name, dest=dest, type=parse, default=default, choices=spec.choices, help=help,
                                metavar=None if spec.choices else name.lstrip("-").replace("-", "_").upper())


def config_parser(cls: type, prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """A parser with a flag for every flagged field of `cls`."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(p, cls)
    return p


def from_args(cls: type[C], namespace: argparse.Namespace, *, prefix: str = "") -> C:
    """The config whose flagged fields come from `namespace` where it has them (the others
    keep their defaults); not validated."""
    values = {f.name: getattr(namespace, prefix + f.name) for f, _, _ in _flagged(cls, None)
              if hasattr(namespace, prefix + f.name)}
    return cls(**values)


def to_argv(cfg: Any) -> list[str]:
    """`cfg` as flags that parse back into it: every value other than its default, and every
    value an environment variable could otherwise replace. Secrets are left out: they travel
    in the environment."""
    argv = []
    for f in dataclasses.fields(cfg):
        value, spec = getattr(cfg, f.name), flag_of(f)
        if spec is None:
            if value != f.default:
                raise ValueError(f"{type(cfg).__name__}.{f.name} has no flag to carry {value!r}")
        elif spec.secret or (value == f.default and spec.env is None):
            continue
        elif isinstance(value, bool):
            if value != f.default:
                argv.append(spec.name)
        else:
            argv.append(f"{spec.name}={_render(value)}")
    return argv
