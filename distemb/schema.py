"""One generic loader for typed configs: fields declare type, default, validator and help.

A config is a frozen dataclass whose fields are made with :func:`option`. :func:`load`
walks the fields of the class, converts each value of a plain mapping (from JSON/YAML)
to the field's type (bool, int, float, str, a :class:`~distemb.enums.Choice`, a nested
config, ``Tuple[X, ...]``, ``Optional[X]``), runs the field's validator, then the class's
cross-field :meth:`Schema.check`, and names the path of the first bad value in its error
(``servers[1].port: must be <= 65535, got 70000``), as PyTorch-BigGraph's schema does.
Defaults are written once, on the field; :func:`default_of` reads them for CLIs.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Shard(Schema):
    ...     rows: int = option(help="rows (> 0)", validator=at_least(1))
    ...     name: str = option("w", help="table name")
    >>> load(Shard, {"rows": 5})
    Shard(rows=5, name='w')
    >>> load(Shard, {"rows": 0}, "tables[2]")
    Traceback (most recent call last):
    ...
    distemb.errors.ConfigError: tables[2].rows: must be >= 1, got 0
"""
import dataclasses
import typing
from enum import Enum

from distemb.enums import Choice
from distemb.errors import ConfigError

_MISSING = dataclasses.MISSING


def option(default=_MISSING, *, help, validator=None):
    """A config field: its default (none: required), help text and validator.

    Args:
        default: the value when the mapping lacks the field; omit for a required field.
            Defaults are trusted: they are not validated.
        help: one line for docs and ``--help``.
        validator: ``f(value, path)`` raising :class:`ConfigError` naming ``path``; runs on
            the converted value.
    """
    return dataclasses.field(default=default, metadata={"help": help, "validator": validator})


def default_of(cls, name):
    """The declared default of field ``name`` of config class ``cls``."""
    default = cls.__dataclass_fields__[name].default
    if default is _MISSING:
        raise KeyError(f"{cls.__name__}.{name} has no default (it is required)")
    return default


def help_of(cls, name):
    """The help text of field ``name`` of config class ``cls``."""
    return cls.__dataclass_fields__[name].metadata["help"]


class Schema:
    """Mixin of config dataclasses: cross-field checks and plain-data output."""

    def check(self):
        """Constraints between fields, run by :func:`load` after the fields are valid.

        Raises:
            ConfigError: message starting with the offending field's path relative to
                this object (``bounds[2]: ...``); :func:`load` prefixes the object's path.
        """

    def to_dict(self):
        """Plain data for JSON/YAML (round-trips through :func:`load`)."""
        return _plain(self)


def load(cls, raw, path=""):
    """Build config class ``cls`` from the mapping ``raw``, validating every field.

    Args:
        cls: a dataclass deriving from :class:`Schema`, fields made with :func:`option`.
        raw: plain data (parsed JSON/YAML).
        path: where ``raw`` sits in the enclosing config ('' for the root).

    Returns:
        the validated ``cls`` instance.

    Raises:
        ConfigError: ``<path>: <what is wrong>, got <value>`` for the first bad value.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or '<root>'}: must be a mapping, got {type(raw).__name__}")
    fields = dataclasses.fields(cls)
    known = [f.name for f in fields]
    extra = sorted(set(raw) - set(known), key=str)
    if extra:
        raise ConfigError(f"{_join(path, extra[0])}: unknown field (allowed: {sorted(known)})")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields:
        where = _join(path, f.name)
        if f.name not in raw:
            if f.default is _MISSING and f.default_factory is _MISSING:
                raise ConfigError(f"{where}: missing")
            continue
        value = _convert(hints[f.name], raw[f.name], where)
        validator = f.metadata.get("validator")
        if validator is not None and value is not None:
            validator(value, where)
        values[f.name] = value
    obj = cls(**values)
    try:
        obj.check()
    except ConfigError as e:
        raise ConfigError(_join(path, str(e))) from None
    return obj


def _join(path, name):
    if not path:
        return name
    return f"{path}{name}" if name.startswith("[") else f"{path}.{name}"


def _convert(tp, value, path):
    """``value`` as type ``tp``, or ConfigError naming ``path``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, path)
    if origin is tuple:  # Tuple[X, ...]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: must be a list, got {value!r:.80}")
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return load(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, Choice):
        return tp.parse(value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{path}: no conversion to {tp!r} (declare a supported field type)")


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


# --- validators: f(value, path) raising ConfigError ----------------------------------


def at_least(minimum):
    """Validator: a number >= ``minimum``."""
    def check(value, path):
        if value < minimum:
            raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return check


def at_most(maximum):
    """Validator: a number <= ``maximum``."""
    def check(value, path):
        if value > maximum:
            raise ConfigError(f"{path}: must be <= {maximum}, got {value}")
    return check


def positive(value, path):
    """Validator: a number > 0."""
    if not value > 0:
        raise ConfigError(f"{path}: must be a number > 0, got {value!r}")


def non_empty(value, path):
    """Validator: a non-empty string or list."""
    if not value:
        kind = "string" if isinstance(value, str) else "list"
        shown = list(value) if isinstance(value, tuple) else value
        raise ConfigError(f"{path}: must be a non-empty {kind}, got {shown!r}")


def equal_to(expected):
    """Validator: exactly ``expected`` (a schema version)."""
    def check(value, path):
        if value != expected:
            raise ConfigError(f"{path}: must be {expected}, got {value!r}")
    return check


def all_of(*validators):
    """Validator: every one of ``validators``, in order."""
    def check(value, path):
        for v in validators:
            v(value, path)
    return check


def each(validator):
    """Validator of a list: ``validator`` on every element, path ``path[i]``."""
    def check(value, path):
        for i, v in enumerate(value):
            validator(v, f"{path}[{i}]")
    return check
