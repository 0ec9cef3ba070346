"""The checkers of the KVStore messages' scalar fields: each takes a decoded value and
says whether it is of its type and within its bounds (what a value means is for the
handler to check). :mod:`distemb.transport.messages` names one per field.

Example:
    >>> int_list([0, 3]), int_list([0, -1]), text("w" * 300), spec_fields({})
    (True, False, False, True)
"""
import numpy as np


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def int_value(v):
    return _is_int(v) and -(1 << 62) < v < (1 << 62)


def int_list(v):
    return isinstance(v, list) and len(v) <= 1 << 16 and all(int_value(x) and x >= 0 for x in v)


def flag(v):
    return isinstance(v, bool)


def text(v):
    return isinstance(v, str) and len(v) <= 256


def abs_path(v):
    return isinstance(v, str) and 1 <= len(v) <= 4096 and v.startswith("/") and v.isprintable()


def scalar_dict(v):
    return isinstance(v, dict) and len(v) <= 64 and all(
        isinstance(k, str) and (isinstance(x, (int, float)) and not isinstance(x, bool))
        for k, x in v.items())


def real(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def choice(*allowed):
    return lambda v: isinstance(v, str) and v in allowed


def layout(v):
    """None, or a partition policy's layout (:func:`~distemb.layouts.policy_layout`)
    as JSON: ``["range", [bounds]]``, ``["hash", P]`` or ``["progressions", [[start,
    step, count], ...]]`` (what each may hold is :func:`~distemb.layouts.layout_policy`'s
    to check)."""
    return v is None or (isinstance(v, list) and len(v) == 2 and (
        (v[0] == "hash" and int_value(v[1])) or (v[0] == "range" and int_list(v[1])) or
        (v[0] == "progressions" and isinstance(v[1], list) and
         len(v[1]) <= 1 << 16 and all(isinstance(p, list) and len(p) == 3 and
                                      all(int_value(x) for x in p) for p in v[1]))))


#: The fields of a table spec (:data:`~distemb.stores.spec.SPECS`) as a Create carries
#: them, each with its type's checker; what each may hold is the spec's to check.
SPEC_FIELDS = {"kind": text, "dim": int_value, "dtype": text, "init": text,
               "init_args": scalar_dict, "capacity": int_value, "evict": text,
               "low_water": real, "rounding": text, "num_rows": int_value, "path": text,
               "preallocate": int_value, "partition": layout, "row_shape": int_list,
               "seed": int_value, "sink": lambda v: v == "" or abs_path(v)}


def spec_fields(v):
    return v == {} or (isinstance(v, dict) and set(v) == set(SPEC_FIELDS) and
                       all(SPEC_FIELDS[k](x) for k, x in v.items()))


def text_list(v):
    return isinstance(v, list) and len(v) <= 8 and all(text(x) for x in v)
