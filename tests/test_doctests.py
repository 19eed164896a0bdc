"""Every docstring example of the package runs and prints what it shows (the API documentation cannot drift from
the code): each module's examples, one test per module."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import neusight

MODULES = sorted(m.name for m in pkgutil.walk_packages(neusight.__path__, "neusight."))


def test_the_package_has_modules_with_examples():
    with_examples = [name for name in MODULES
                     if any(t.examples for t in doctest.DocTestFinder().find(importlib.import_module(name), name))]
    assert len(with_examples) >= 10, with_examples


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(verbose=False)
    for test in doctest.DocTestFinder().find(module, name):
        if test.examples:
            runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert failed == 0, f"{failed} of {attempted} docstring examples of {name} failed (output above)"
