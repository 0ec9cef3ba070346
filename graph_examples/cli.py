"""What the graph examples' command lines share: ``--data-opt KEY=VALUE`` values, the
two-column tables they print, and how a process joins a job (launched, torchrun, alone).

Example:
    >>> data_option("walk_length=40")
    ('walk_length', 40)
    >>> print(format_table([("a", 1), ("bcd", 2)]))
    a    1
    bcd  2
"""
import argparse
import ast
import os


def data_option(text: str):
    """``--data-opt KEY=VALUE``: (key, the value as a Python literal, else as text)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--data-opt: expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a plain string such as a path


def format_table(rows) -> str:
    """Return (name, value) rows as an aligned two-column text table."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def job_mode():
    """How this process joins a job: "" as a trainer of a distemb-launch job
    (``$DISTEMB_CONFIG``), "collective" as a rank under torchrun (``$TORCHELASTIC_RUN_ID``:
    no servers, every rank holds a shard of every table), None alone (embedded)."""
    if os.environ.get("DISTEMB_CONFIG"):
        return ""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "collective"
    return None
