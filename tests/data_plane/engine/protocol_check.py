"""Does an object implement a typing.Protocol member by member? (No type checker runs in CI, so the
engine protocol is checked here: names, parameters, annotations, async-ness and attribute types.)"""

from __future__ import annotations

import inspect
import typing
from collections.abc import AsyncGenerator
from typing import Protocol


def protocol_members(proto: type) -> dict[str, object]:
    """name -> the protocol's declaration (a function, or the annotation of a data member), including
    the members of the protocols it extends; the most derived declaration wins."""
    members: dict[str, object] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        hints = typing.get_type_hints(cls)
        for name in cls.__dict__.get("__annotations__", {}):
            members[name] = hints[name]
        for name, value in cls.__dict__.items():
            if name.startswith("_"):
                continue
            if isinstance(value, property):
                members[name] = typing.get_type_hints(value.fget)["return"]
            elif inspect.isfunction(value):
                members[name] = value
    return members


def mismatches(obj: object, proto: type) -> list[str]:
    """What `obj` lacks or declares differently from `proto` (empty: it implements it)."""
    problems = []
    for name, declared in protocol_members(proto).items():
        if not hasattr(obj, name):
            problems.append(f"{name}: missing")
            continue
        actual = getattr(obj, name)
        if inspect.isfunction(declared):
            problems += _method_mismatches(name, declared, actual)
        elif not _is_instance(actual, declared):
            problems.append(f"{name}: {type(actual).__name__} is not {declared}")
    return problems


def _method_mismatches(name: str, declared: typing.Callable, actual: object) -> list[str]:
    if not callable(actual):
        return [f"{name}: not callable"]
    impl = getattr(actual, "__func__", actual)
    want, got = inspect.signature(declared), inspect.signature(impl)
    problems = []
    if list(want.parameters) != list(got.parameters):
        problems.append(f"{name}: parameters {list(got.parameters)}, protocol {list(want.parameters)}")
    want_hints, got_hints = typing.get_type_hints(declared), typing.get_type_hints(impl)
    want_return, got_return = want_hints.pop("return", None), got_hints.pop("return", None)
    if want_hints != got_hints or not _returns(got_return, want_return):
        problems.append(f"{name}: annotations {got_hints} -> {got_return}, protocol {want_hints} -> {want_return}")
    returns_stream = typing.get_origin(want_return) is AsyncGenerator
    if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(impl):
        problems.append(f"{name}: async-ness differs from the protocol")
    if returns_stream and not inspect.isasyncgenfunction(impl):
        problems.append(f"{name}: the protocol returns an async generator; this is not one")
    return problems


def _returns(got: object, want: object) -> bool:
    """The same return type, or a narrower one: a subclass, or a class with every member of a protocol."""
    if got == want:
        return True
    if not (inspect.isclass(got) and inspect.isclass(want)):
        return False
    if getattr(want, "_is_protocol", False):
        declared = typing.get_type_hints(got)
        return all(name in declared or hasattr(got, name) for name in protocol_members(want))
    return issubclass(got, want)


def _is_instance(value: object, declared: object) -> bool:
    try:
        return isinstance(value, declared)  # classes and X | None unions
    except TypeError:  # a subscripted generic: its origin is what can be checked
        return isinstance(value, typing.get_origin(declared) or object)
