"""A griffe extension for the API reference: read distemb's docstrings as they are meant.

- ``Example:`` is an examples section. distemb's docstrings write the singular (STYLE.md:
  an Example on every public class); griffe's Google parser knows only the plural as a
  section and would render the doctest lines as quoted text.
- Sphinx roles (``:func:`x```, ``:class:`~a.B```) become code, as Markdown has no roles.

The docstrings stay as they are (doctest runs them: tests/test_docs.py).
"""
import re

import griffe

SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([^`]+)`")


class ExampleSections(griffe.Extension):
    def _fix(self, obj):
        if obj.docstring is not None:
            text = SINGULAR.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = ROLE.sub(r"`\1`", text)

    def on_instance(self, *, obj, **kwargs):
        self._fix(obj)
