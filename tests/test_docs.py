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
