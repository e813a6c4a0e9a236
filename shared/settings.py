"""One configuration style for every process: a dataclass whose fields say where their values come from.

Each field of a process's config (EngineConfig, RouterConfig, ControlPlaneSettings, `loraplane up`'s UpConfig)
is made by `setting(default, flag=..., env=..., help=..., secret=..., ...)`, which keeps the field's flag, its
LORAPLANE_* variable, its default and its help together in the field's metadata. From that metadata:
- `SettingsParser(cls)` is the process's argparse parser (help sections, `--x/--no-x` booleans, repeatable
  lists, choices, deprecated spellings that warn, the variables without a flag listed after the options),
  and its parse resolves every field: a flag given > its variable (or a deprecated one) > the default;
- `from_args(cls, args)` builds the config from that namespace: nothing is copied by hand;
- `resolve(cls, env, given)` is the same precedence without a command line (a config from the environment);
- `settings_repr` shows every field but secrets (`<hidden>`, or how many there are) and masks what `mask` says.
Secrets (`secret=True`) come from their variable or the file `<VARIABLE>_FILE` names; only the engine's
vLLM flags (--api-key, --admin-token) and --control-plane-token also take one on the command line.
Validation stays in each config's __post_init__; `check_choices` checks the fields that have `choices`.
The options several processes share (--host, --port, --log-level, --log-format) are defined here once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from shared.logging_setup import LOG_FORMAT_ENV, LOG_FORMATS, LOG_LEVELS
from shared.secret_env import read_secret

_METADATA_KEY = "loraplane.setting"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_DEPRECATIONS = "deprecations"  # the namespace attribute that lists the deprecated spellings used


class SettingError(ValueError):
    """A variable's value cannot be used; the message names the variable, never a secret's value."""


@dataclass(frozen=True)
class Alias:
    """A deprecated spelling of a setting: a flag (`--old-name`) or a variable; `note` ends its warning."""

    name: str
    note: str = "the same value"


@dataclass(frozen=True)
class Setting:
    """Where one field's value comes from and how it is shown (see `setting`)."""

    flag: str | None = None
    env: str | None = None
    help: str = ""
    secret: bool = False
    choices: tuple[object, ...] | None = None
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None
    group: str | None = None
    aliases: tuple[Alias, ...] = ()
    required: bool = False
    default_text: str | None = None
    mask: Callable[[Any], str] | None = None
    separators: str = ","


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, flag: str | None = None,
            env: str | None = None, help: str = "", secret: bool = False,
            choices: Sequence[object] | None = None, metavar: str | None = None,
            parse: Callable[[Any], Any] | None = None, group: str | None = None, aliases: Sequence[Alias] = (),
            required: bool = False, default_text: str | None = None, mask: Callable[[Any], str] | None = None,
            separators: str = ",") -> Any:
    """A dataclass field with its sources.

    flag: the option (`--max-num-seqs`); None: none. env: the variable; None: none. secret: hidden in repr,
    read from the variable or `<env>_FILE`. parse: text -> value (default: the field's type: str, int, float,
    Path; bool: `--x/--no-x`); for a list, tuple or mapping field (a repeatable flag, a variable split on
    `separators`) it gets the list of items. group: the help section. aliases: deprecated spellings.
    default_text: the default as the help shows it (default: the default's value). mask: the value as repr
    shows it (a URL without its password)."""
    meta = Setting(flag, env, help, secret, None if choices is None else tuple(choices), metavar, parse, group,
                   tuple(aliases), required, default_text, mask, separators)
    return field(default=default, default_factory=default_factory, metadata={_METADATA_KEY: meta})


# --- the options several processes share


def host_setting(*, env: str | None = None) -> Any:
    return setting("127.0.0.1", flag="--host", env=env, group="HTTP", metavar="ADDRESS",
                   help="the address to listen on (0.0.0.0 or :: for every interface)")


def port_setting(default: int, *, env: str | None = None, free: bool = True, what: str = "") -> Any:
    """--port: this process's port (`what` says whose, where a command starts several)."""
    pick = "; 0 picks a free port (printed at start)" if free else ""
    return setting(default, flag="--port", env=env, group="HTTP", metavar="PORT",
                   help=f"the port {what or 'to listen on'}{pick}")


def log_level_setting() -> Any:
    return setting("info", flag="--log-level", env="LORAPLANE_LOG_LEVEL", choices=LOG_LEVELS, parse=str.lower,
                   group="logging", help="the lowest level logged; at debug, every HTTP request is logged too")


def log_format_setting() -> Any:
    return setting("text", flag="--log-format", env=LOG_FORMAT_ENV, choices=LOG_FORMATS, group="logging",
                   help="text, or json: one object per line with time, level, logger, message")


# --- reading the fields


@dataclass(frozen=True)
class _Spec:
    """A field, its setting and its shape: `many` takes items (a repeatable flag, a split variable)."""

    field: Field[Any]
    setting: Setting
    kind: str  # "bool" | "scalar" | "many"
    parse: Callable[[Any], Any]

    @property
    def name(self) -> str:
        return self.field.name


@cache
def _specs(cls: type) -> tuple[_Spec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in fields(cls):
        s = f.metadata.get(_METADATA_KEY) or Setting()  # a plain field: no flag, no variable
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint) or hint
        if hint is bool:
            specs.append(_Spec(f, s, "bool", s.parse or _parse_bool))
        elif origin in (list, tuple, frozenset, set, dict, Mapping):
            if s.parse is None and origin in (dict, Mapping):
                raise TypeError(f"{cls.__name__}.{f.name}: a mapping setting needs parse=")
            specs.append(_Spec(f, s, "many", s.parse or origin))
        else:
            specs.append(_Spec(f, s, "scalar", s.parse or origin))
    return tuple(specs)


def _parse_bool(text: str) -> bool:
    if text.strip().lower() in _TRUE + _FALSE:
        return text.strip().lower() in _TRUE
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def _alternatives(choices: Sequence[object]) -> str:
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _from_text(spec: _Spec, variable: str, raw: str) -> Any:
    """A variable's text as the field's value; SettingError names the variable (a secret's value never)."""
    s = spec.setting
    shown = "" if s.secret else f", not {raw!r}"
    try:
        if spec.kind == "many":
            items = [item.strip() for item in re.split(f"[{re.escape(s.separators)}]", raw)]
            value = spec.parse([item for item in items if item])
        else:
            value = spec.parse(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        if spec.parse in (int, float):
            raise SettingError(f"{variable} must be {'an integer' if spec.parse is int else 'a number'}{shown}") \
                from None
        raise SettingError(f"{variable}: {exc}") from None
    if s.choices is not None and value not in s.choices:
        raise SettingError(f"{variable} {raw!r}: expected {_alternatives(s.choices)}")
    return value


def _variable(spec: _Spec, env: Mapping[str, str]) -> tuple[str, str, Alias | None] | None:
    """(the variable, its text, the alias it is) of the first of the setting's variables that is set."""
    s = spec.setting
    names: list[tuple[str, Alias | None]] = [(s.env, None)] if s.env else []
    names += [(a.name, a) for a in s.aliases if not a.name.startswith("--")]
    for name, alias in names:
        try:
            raw = read_secret(env, name) if s.secret else env.get(name)
        except ValueError as exc:  # an unreadable <NAME>_FILE
            raise SettingError(str(exc)) from None
        if raw:
            return name, raw, alias
    return None


def resolve(cls: type, env: Mapping[str, str], given: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The fields' values: given (not None) > the field's variable (or a deprecated one) > left out (the
    dataclass default applies); and the warnings for the deprecated variables used. SettingError: a
    variable that cannot be read."""
    values = {name: value for name, value in given.items() if value is not None}
    deprecations: list[str] = []
    for spec in _specs(cls):
        if spec.name in values:
            continue
        found = _variable(spec, env)
        if found is not None:
            name, raw, alias = found
            values[spec.name] = _from_text(spec, name, raw)
            if alias is not None:
                deprecations.append(f"{name} is deprecated; set {spec.setting.env} ({alias.note})")
    return values, deprecations


def secrets_from(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """Every secret field of `cls`: from its variable (or that variable's file), else its default."""
    values, _ = resolve(cls, env, {})
    return {spec.name: values.get(spec.name, _default(spec.field)) for spec in _specs(cls) if spec.setting.secret}


def from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The config `cls` from a SettingsParser's namespace (every field resolved), `fixed` over it."""
    return cls(**{spec.name: getattr(args, spec.name) for spec in _specs(cls)} | fixed)


def deprecations(args: argparse.Namespace) -> list[str]:
    """The warnings for the deprecated flags and variables a SettingsParser's parse met."""
    return list(getattr(args, _DEPRECATIONS, []))


def check_choices(config: object, error: type[Exception] = ValueError) -> None:
    """Each field that has choices holds one of them (or None): `--flag 'value': expected a, b or c`."""
    config_type: type = type(config)  # (type[object] reads as unhashable to the checker)
    for spec in _specs(config_type):
        value, choices = getattr(config, spec.name), spec.setting.choices
        if choices is not None and value is not None and value not in choices:
            raise error(f"{spec.setting.flag or spec.name} {value!r}: expected {_alternatives(choices)}")


def settings_repr(config: object) -> str:
    """`Cls(field=value, …)` with secrets hidden: `<hidden>`, `<N hidden>`, a mapping's keys only."""
    parts = []
    config_type: type = type(config)
    for spec in _specs(config_type):
        value, s = getattr(config, spec.name), spec.setting
        if s.secret and value is not None:
            if isinstance(value, Mapping):
                text = f"<{len(value)} hidden: {sorted(value)}>"
            else:
                text = "<hidden>" if isinstance(value, str) else f"<{len(value)} hidden>"
        else:
            text = repr(s.mask(value) if s.mask is not None and value is not None else value)
        parts.append(f"{spec.name}={text}")
    return f"{type(config).__name__}({', '.join(parts)})"


# --- the command line


def _help(spec: _Spec) -> str:
    """The help text, then its variable and default; a flag's help, escaped for argparse."""
    s, f = spec.setting, spec.field
    notes = []
    if s.flag is not None and spec.kind == "many":
        notes.append("repeatable")
    if s.flag is not None and s.env:
        notes.append(f"${s.env}" + (f" or the file ${s.env}_FILE names" if s.secret else ""))
    notes += [f"${a.name}, deprecated" for a in s.aliases if not a.name.startswith("--")]
    default = s.default_text
    if default is None and f.default is not MISSING and f.default not in (None, "", ()):
        default = ("on" if f.default else "off") if spec.kind == "bool" else str(f.default)
    if default is not None:
        notes.append(f"default: {default}")
    if s.flag is not None and s.secret:
        notes.append("prefer the variable: a flag shows in `ps`")
    text = s.help + (f" ({'; '.join(notes)})" if notes else "")
    return text.replace("%", "%%") if s.flag is not None else text


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse's type: its own messages for the built-in types, the parse function's message otherwise."""
    if parse in (str, int, float, Path):
        return parse

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _alias_dest(alias: Alias) -> str:
    return f"{_DEPRECATIONS}:{alias.name}"


def _environment_epilog(cls: type) -> str | None:
    """The variables that have no flag, with their help: the rest of the process's configuration."""
    specs = [spec for spec in _specs(cls) if spec.setting.env and not spec.setting.flag]
    if not specs:
        return None
    width = max(40, min(shutil.get_terminal_size().columns - 2, 120))
    lines = ["environment variables without a flag (a secret may instead be in the file <VARIABLE>_FILE names):"]
    for spec in specs:
        lines.append(f"  {spec.setting.env}" + (" (secret)" if spec.setting.secret else ""))
        lines += textwrap.wrap(_help(spec), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


class SettingsParser(argparse.ArgumentParser):
    """An ArgumentParser whose options are the flags of the settings dataclass `settings`; its parse also
    resolves every field (a flag given > its variable > the default), so the namespace holds the whole
    config, and a variable that cannot be read is a usage error that names it. `env` defaults to
    os.environ as it is when parsing."""

    def __init__(self, settings: type | None = None, *, env: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        if settings is not None:
            kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
            kwargs.setdefault("epilog", _environment_epilog(settings))
        super().__init__(**kwargs)
        self.settings, self.env = settings, env
        if settings is not None:
            self._add_settings(settings)

    def _add_settings(self, cls: type) -> None:
        groups: dict[str, argparse._ArgumentGroup] = {}
        for spec in _specs(cls):
            s = spec.setting
            if s.flag is None:
                continue
            if s.group is not None and s.group not in groups:
                groups[s.group] = self.add_argument_group(s.group)
            target = groups[s.group] if s.group is not None else self
            kwargs: dict[str, Any] = {"dest": spec.name, "default": None, "help": _help(spec)}
            if spec.kind == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            elif spec.kind == "many":
                kwargs.update(nargs="+", action="extend", metavar=s.metavar)
            else:
                kwargs.update(type=_flag_type(spec.parse), metavar=s.metavar, choices=s.choices)
            target.add_argument(s.flag, required=s.required, **kwargs)
            for alias in s.aliases:
                if alias.name.startswith("--"):  # one value per use, as deprecated flags took
                    target.add_argument(alias.name, dest=_alias_dest(alias), action="append", metavar=s.metavar,
                                        help=f"deprecated: the old name of {s.flag} (one value per flag)")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        # argparse's own default (a new Namespace), passed here so that the result is typed a Namespace
        parsed, extras = super().parse_known_args(args, argparse.Namespace() if namespace is None else namespace)
        if self.settings is not None:
            self._resolve(self.settings, parsed)
        return parsed, extras

    def _resolve(self, cls: type, namespace: argparse.Namespace) -> None:
        given: dict[str, Any] = {}
        used: list[str] = []
        for spec in _specs(cls):
            s = spec.setting
            if s.flag is None:
                continue
            value = getattr(namespace, spec.name, None)
            for alias in (a for a in s.aliases if a.name.startswith("--")):
                old = getattr(namespace, _alias_dest(alias), None)
                if old is not None:
                    more = "…" if spec.kind == "many" else ""
                    used.append(f"{alias.name} is deprecated; use {s.flag} {s.metavar or spec.name.upper()}{more} "
                                f"({alias.note})")
                    value = [*(value or []), *old] if spec.kind == "many" else (old[-1] if value is None else value)
            if value is not None and spec.kind == "many":
                try:
                    value = spec.parse(value)
                except ValueError as exc:
                    self.error(str(exc))
            given[spec.name] = value
        try:
            values, from_env = resolve(cls, os.environ if self.env is None else self.env, given)
        except SettingError as exc:
            self.error(str(exc))
        for spec in _specs(cls):
            setattr(namespace, spec.name, values[spec.name] if spec.name in values else _default(spec.field))
        setattr(namespace, _DEPRECATIONS, used + from_env)
