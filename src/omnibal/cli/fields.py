"""Argparse arguments generated from a config dataclass's fields: the field is the one declaration of a knob.

The flag is the field name in kebab case (``max_tiles`` -> ``--max-tiles``), the help is the docstring under
the field, and the type and choices follow the annotation: a ``StrEnum`` or ``Literal`` gives choices, ``bool``
a ``--x/--no-x`` pair, ``tuple[int, ...]`` a comma list, ``X | None`` a flag that may be left unset. A field's
``metadata`` may give another spelling (``{"flag": "--steps"}``), a short flag (``{"short": "-n"}``), more
spellings (``{"also": ("--log",)}``), a metavar, a parser (``{"parse": fn}``: a nested dataclass field with
one is one argument, not flat), a default of the command line's own (``{"cli_default": value}``, where the
subcommand runs another than a library caller's; a string is parsed as the flag's value is), or
``{"cli": False}`` to keep it off the command line.
A knob several subcommands share is spelled by its :data:`omnibal.cli.options.OPTIONS`
entry (its flag and short flags): the entry of the field's name, or of its metadata's
``option``; the argument's dest is then the entry's key, so every subcommand stores it under one name.
A nested dataclass field (``layout``) contributes its own fields flat; :func:`config_from_args` builds the
nested value from the field's default (or its ``cli_default``) and the given ones. Its metadata's ``fields``
(``{"dp_size": help or None}``) offers only those of the nested fields, each with this command's help (None:
the nested field's docstring).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import enum
import inspect
import re
import textwrap
import types
import typing


def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string literal right under its annotation), whitespace collapsed."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except OSError:  # made at run time (``make_dataclass``): no docstrings to read
            continue
        tree = ast.parse(textwrap.dedent(source))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                text = re.sub(r":\w+:`~?([^`]*)`", r"\1", " ".join(nxt.value.value.split()))
                docs[stmt.target.id] = text.replace("``", "`")
    return docs


def flag_of(f: dataclasses.Field) -> str:
    """The field's long flag: its metadata's ``flag``, else the name in kebab case."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _comma_list(item_type):
    def parse(text: str) -> tuple:
        return tuple(item_type(part.strip()) for part in text.split(",") if part.strip())
    parse.__name__ = f"comma-separated {item_type.__name__}"
    return parse


def _usage_errors(parse):
    """``parse`` whose InputError argparse reports as its own message (``argument --chunks: must be ...``),
    not as ``invalid parse_chunks value``."""
    from omnibal.errors import InputError

    def checked(text: str):
        try:
            return parse(text)
        except InputError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
    checked.__name__ = parse.__name__
    return checked


def argument_kwargs(f: dataclasses.Field, tp, doc: str) -> dict:
    """``add_argument`` keywords of one field (no default, so the dataclass's own applies, unless the field
    declares a ``cli_default``)."""
    tp, _ = _unwrap_optional(tp)
    kw: dict = {"dest": option_key(f) or f.name, "help": f.metadata.get("help", doc).replace("%", "%%"),
                "default": f.metadata.get("cli_default", argparse.SUPPRESS)}
    if "metavar" in f.metadata:
        kw["metavar"] = f.metadata["metavar"]
    origin = typing.get_origin(tp)
    if "choices" in f.metadata:  # a subset of the annotation's vocabulary
        kw["choices"] = tuple(f.metadata["choices"])
    elif "parse" in f.metadata:
        kw["type"] = _usage_errors(f.metadata["parse"])
    elif tp is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        kw["choices"] = tuple(m.value for m in tp)
    elif origin is typing.Literal:
        kw["choices"] = typing.get_args(tp)
    elif origin is tuple and len(typing.get_args(tp)) == 2 and typing.get_args(tp)[1] is Ellipsis:
        kw["type"] = _comma_list(typing.get_args(tp)[0])
    elif tp in (int, float, str):
        kw["type"] = tp
        if tp is int:
            kw.setdefault("metavar", "N")
    else:
        raise TypeError(f"field {f.name}: no command-line form for {tp!r}; give metadata parse= or cli=False")
    return kw


def _is_flat(f: dataclasses.Field, tp) -> bool:
    """Whether a field contributes its own fields flat: a nested dataclass without a parser of its own."""
    return dataclasses.is_dataclass(tp) and "parse" not in f.metadata


def cli_fields(cls) -> list[tuple[dataclasses.Field, object, str]]:
    """(field, resolved annotation, docstring) of every field on the command line, nested dataclasses flat."""
    hints = typing.get_type_hints(cls, include_extras=False)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        if _is_flat(f, hints[f.name]):
            offered = f.metadata.get("fields")
            out.extend((inner, tp, doc if offered is None else offered[inner.name] or doc)
                       for inner, tp, doc in cli_fields(hints[f.name]) if offered is None or inner.name in offered)
        else:
            out.append((f, hints[f.name], docs.get(f.name, "")))
    return out


def option_key(f: dataclasses.Field) -> str | None:
    """The shared option (:data:`omnibal.cli.options.OPTIONS` key) that spells the field, if any."""
    from omnibal.cli.options import OPTIONS

    key = f.metadata.get("option", f.name)
    return key if key in OPTIONS else None


def default_note(f: dataclasses.Field, help: str) -> str:
    """`` (default: X)`` for the help of a field with a plain default (not None, a flag's bool, a factory's
    object or one the help already names), as the subcommands' formatter shows a hand-written option's."""
    default = f.default
    if (default is dataclasses.MISSING or default is None or isinstance(default, bool) or "cli_default" in f.metadata
            or "default" in help.lower()):
        return ""
    text = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    return f" (default: {text})"


def _own_defaults(cls) -> set[dataclasses.Field]:
    """The fields whose own default is what the command line leaves unset: those of ``cls``, and of a nested
    config whose default is its class's own (``default_factory=BalanceConfig``); another nested default
    (``PLAN_LAYOUT``) need not be its fields' defaults."""
    hints = typing.get_type_hints(cls, include_extras=False)
    own = set(dataclasses.fields(cls))
    for f in dataclasses.fields(cls):
        if _is_flat(f, hints[f.name]) and f.default_factory is hints[f.name] and "cli_default" not in f.metadata:
            own |= _own_defaults(hints[f.name])
    return own


def add_config_arguments(parser, cls, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Add one argument per command-line field of ``cls`` (but ``skip``); returns {field name: long flag}."""
    from omnibal.cli.options import OPTIONS, add_option

    flags = {}
    own = _own_defaults(cls)
    for f, tp, doc in cli_fields(cls):
        if f.name in skip:
            continue
        kw = argument_kwargs(f, tp, doc)
        if f in own:
            kw["help"] += default_note(f, kw["help"])
        key = option_key(f)
        if key is not None:
            opt = OPTIONS[key]
            if "action" in opt.kwargs:  # the shared spelling's action (store_true) wins over the annotation's
                kw = {k: v for k, v in kw.items() if k not in ("action", "type", "choices")}
            elif "choices" in kw:  # the field's choices: this subcommand's subset of the shared list
                kw.pop("type", None)
            elif "parse" in f.metadata:  # the field's parser says what it takes (cuda:1 beside the shared list)
                kw["choices"] = None
            kw.pop("dest")
            add_option(parser, key, **kw)
            flags[f.name] = opt.flag
            continue
        names = [flag_of(f), *f.metadata.get("also", ()), *([f.metadata["short"]] if "short" in f.metadata else [])]
        parser.add_argument(*names, **kw)
        flags[f.name] = names[0]
    return flags


def config_flags(cls) -> dict[str, str]:
    """{field name: long flag} of every command-line field of ``cls``, nested ones included."""
    from omnibal.cli.options import OPTIONS

    return {f.name: OPTIONS[key].flag if (key := option_key(f)) else flag_of(f) for f, _, _ in cli_fields(cls)}


@contextlib.contextmanager
def errors_named_by_flags(cls):
    """An :class:`~omnibal.errors.InputError` a job or config raises about a field of ``cls`` (``field=`` its
    name, and no ``source`` or the field's name itself) is named by the field's flag: the job knows its config,
    the command line its spelling."""
    from omnibal.errors import InputError

    try:
        yield
    except InputError as exc:
        flag = config_flags(cls).get(exc.field) if exc.field and exc.source in (None, exc.field) else None
        if flag is not None:
            exc.source = flag
            exc.args = (exc._format(),)
        raise


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` built from the parsed fields the user gave (the dataclass defaults the rest); a nested dataclass
    field (``layout``) is the field's default with the given values replaced."""
    return cls(**{**_given_fields(cls, args), **overrides})


def _given_fields(cls, args: argparse.Namespace) -> dict:
    """{field name: value} of the command-line fields of ``cls`` the user gave, nested dataclasses built."""
    hints = typing.get_type_hints(cls, include_extras=False)
    given = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        if _is_flat(f, hints[f.name]):
            offered = f.metadata.get("fields")
            inner = {k: v for k, v in _given_fields(hints[f.name], args).items() if offered is None or k in offered}
            default = (f.metadata["cli_default"] if "cli_default" in f.metadata else
                       f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if inner:
                given[f.name] = hints[f.name](**inner) if default is None else dataclasses.replace(default, **inner)
            elif "cli_default" in f.metadata:
                given[f.name] = default
        elif hasattr(args, option_key(f) or f.name):
            given[f.name] = getattr(args, option_key(f) or f.name)
    return given
