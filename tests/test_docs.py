"""Every docstring Example in the distemb package runs and prints what it claims."""
import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import distemb

MODULES = sorted(m.name for m in pkgutil.walk_packages(distemb.__path__, "distemb.")
                 if importlib.util.find_spec(m.name).origin.endswith(".py"))  # not compiled


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_every_public_class_has_an_example():
    missing = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (isinstance(obj, type) and obj.__module__ == name and not attr.startswith("_")
                    and issubclass(obj, object) and obj.__doc__ is not None
                    and "Example" not in obj.__doc__ and "Example" not in (module.__doc__ or "")):
                missing.append(f"{name}.{attr}")
    assert not missing, f"public classes without an Example: {missing}"


def _resolves(dotted):
    """Whether ``dotted`` (``distemb.a.b`` or ``distemb.a.B.c``) names a module or an
    attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_the_code_mentions_exists():
    """A docstring or comment naming ``distemb.x.y`` (a module, class or function) names
    one that exists: a reader sent to a module that was renamed or merged away finds
    nothing (table_cache.py named ``distemb.kvstore.cache_keys``, which never existed)."""
    import re
    from pathlib import Path

    root = Path(distemb.__file__).parent
    dotted = re.compile(r"(?<![\w./])distemb(?:\.[A-Za-z_]\w*)+")
    missing = set()
    for path in root.rglob("*.py"):
        for name in dotted.findall(path.read_text()):
            name = name.rstrip(".")
            if not _resolves(name):
                missing.add(f"{path.relative_to(root.parent)}: {name}")
    assert not missing, "\n".join(sorted(missing))
