"""The package surface: the type stubs describe exactly the compiled module, the marker file
for typed packages is installed, and every example in the docstrings runs as written."""

from __future__ import annotations

import ast
import doctest
import importlib.resources
import inspect
import pathlib

import kvtrie
import kvtrie.ray
from kvtrie import _kvtrie

STUB = pathlib.Path(kvtrie.__file__).with_name("_kvtrie.pyi")


def stub_tree():
    return ast.parse(STUB.read_text())


def member_name(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def stub_classes():
    """{class name: {member names}} of the stub."""
    return {
        node.name: {m for m in map(member_name, node.body) if m}
        for node in stub_tree().body
        if isinstance(node, ast.ClassDef)
    }


def runtime_public(cls):
    return {n for n in vars(cls) if not n.startswith("_")}


def test_py_typed_and_stub_are_installed():
    files = importlib.resources.files("kvtrie")
    assert files.joinpath("py.typed").is_file()
    assert files.joinpath("_kvtrie.pyi").is_file()


def test_stub_declares_every_runtime_name_and_nothing_else():
    stubs = stub_classes()
    module_level = {m for m in map(member_name, stub_tree().body) if m}
    runtime = {n for n in dir(_kvtrie) if not n.startswith("_") or n == "__version__"}
    assert runtime == module_level
    for name, members in stubs.items():
        cls = getattr(_kvtrie, name)
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        have = runtime_public(cls)
        if name == "KvEvent":
            have -= {"Stored", "Removed", "Cleared"}
            members = members - {"Stored", "Removed", "Cleared"}
        assert have == members - {"__init__", "__len__", "__match_args__"} - {
            m for m in members if m.startswith("__")
        }, name


def test_every_public_name_is_documented():
    for name in kvtrie.__all__:
        obj = getattr(kvtrie, name)
        if inspect.isclass(obj) or inspect.ismodule(obj) or callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name
    for name in ("PrefixTree", "PrefixAffinityRouter", "KvAwareRouter", "BlockIndex"):
        cls = getattr(kvtrie, name)
        for member, value in vars(cls).items():
            if not member.startswith("_"):
                assert value.__doc__ and value.__doc__.strip(), f"{name}.{member}"


def docstrings():
    """(name, docstring) of the modules, classes and their members."""
    yield "kvtrie", kvtrie.__doc__
    yield "kvtrie.ray", kvtrie.ray.__doc__
    yield "kvtrie.vllm", kvtrie.vllm.__doc__
    yield "kvtrie.zmq", kvtrie.zmq.__doc__
    for name in dir(_kvtrie):
        obj = getattr(_kvtrie, name)
        if inspect.isclass(obj):
            yield name, obj.__doc__
            for member, value in vars(obj).items():
                doc = getattr(value, "__doc__", None)
                if isinstance(doc, str) and not member.startswith("__"):
                    yield f"{name}.{member}", doc
        elif callable(obj):
            yield name, obj.__doc__


def test_docstring_examples_run():
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    examples = 0
    for name, doc in docstrings():
        if not doc:
            continue
        test = parser.get_doctest(doc, {"kvtrie": kvtrie}, name, None, 0)
        examples += len(test.examples)
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0
    assert examples >= 60
