"""The package surface: the type stubs describe exactly the compiled module, the marker file
for typed packages is installed, and every example in the docstrings runs as written."""

from __future__ import annotations

import ast
import doctest
import importlib.resources
import inspect
import pathlib
import re

import kvtrie
import kvtrie.ray
from conftest import require
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


def test_star_imports_of_the_submodules_give_their_documented_classes():
    for module, names in {
        "kvtrie.zmq": {"EngineConfig", "Subscriber"},
        "kvtrie.vllm": {"DecodeError", "DecodedBatch", "DecodedEvent", "Decoder", "decode_batch"},
        "kvtrie.ray": {
            "PrefixCacheAffinityRouter", "TreeActorStandIn", "shared_router", "shared_tree"
        },
    }.items():
        namespace: dict = {}
        exec(f"from {module} import *", namespace)
        namespace.pop("__builtins__")
        assert set(namespace) == names, module
    assert kvtrie.zmq.Subscriber is _kvtrie.Subscriber
    assert kvtrie.zmq.EngineConfig is _kvtrie.EngineConfig


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


def test_the_long_lived_objects_can_be_weakly_referenced():
    # Caches and registries (Ray's among them) hold routers, trees and indexes weakly; each
    # reference dies with its object.
    import gc
    import weakref

    index = kvtrie.BlockIndex()
    engine = kvtrie.zmq.EngineConfig("tcp://127.0.0.1:1", worker=0)
    objects = [
        kvtrie.PrefixTree(),
        index,
        kvtrie.KvAwareRouter(index=index),
        kvtrie.PrefixAffinityRouter(),
        kvtrie.zmq.Subscriber(kvtrie.BlockIndex(), [engine]),
    ]
    refs = [weakref.ref(o) for o in objects]
    assert [r() for r in refs] == objects
    objects[-1].stop()
    del objects, index
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_reprs_show_the_configuration_in_pythons_notation():
    engine = kvtrie.zmq.EngineConfig("tcp://127.0.0.1:1", worker=3)
    assert repr(engine) == "kvtrie.zmq.EngineConfig('tcp://127.0.0.1:1', worker=3, replay_endpoint=None)"
    engine = kvtrie.zmq.EngineConfig("tcp://127.0.0.1:1", worker=3, replay_endpoint="tcp://127.0.0.1:2")
    assert repr(engine).endswith("replay_endpoint='tcp://127.0.0.1:2')")
    assert repr(kvtrie.vllm.Decoder(4, "ns", 16)) == (
        "kvtrie.vllm.Decoder(block_size=4, namespace='ns', engine_block_size=16)"
    )
    assert repr(kvtrie.vllm.Decoder()) == (
        "kvtrie.vllm.Decoder(block_size=16, namespace='', engine_block_size=None)"
    )
    sub = kvtrie.zmq.Subscriber(kvtrie.BlockIndex(), [engine])
    assert repr(sub) == "kvtrie.zmq.Subscriber(engines=['tcp://127.0.0.1:1'], running=True)"
    sub.stop()
    assert repr(sub).endswith("running=False)")
    router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(block_size=4))
    s = router.select_and_reserve(1, list(range(8)), [0])
    assert repr(s) == (
        "Selection(worker=0, overlap_blocks=0, weighted_overlap=0.0, cost=2.0, "
        "prefill_blocks=2, decode_blocks=2)"
    )
    # Strings in Python's notation (they were Rust's: "x\u{1}"), and every field shown:
    # two events of different block sizes printed alike.
    salted = kvtrie.KvAwareConfig(block_size=4, salt=("lo\x01ra", "ns'"))
    assert "salt=('lo\\x01ra', \"ns'\")," in repr(salted), repr(salted)
    ev = kvtrie.vllm.DecodedEvent(kvtrie.KvEvent.Cleared(), 4, "x\x7f", 2)
    assert repr(ev) == (
        "DecodedEvent(event=KvEvent.Cleared(), block_size=4, medium='x\\x7f', group_idx=2)"
    )
    assert repr(kvtrie.vllm.DecodedEvent(kvtrie.KvEvent.Cleared(), 16)) == (
        "DecodedEvent(event=KvEvent.Cleared(), block_size=16, medium=None, group_idx=None)"
    )


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_examples_run_and_show_what_their_comments_say():
    # Every ```python block of the package README runs, in order, in one namespace; a
    # statement whose line ends in a comment holding a Python literal must evaluate to it.
    text = README.read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 3
    ns: dict = {}
    checked = 0
    for block in blocks:
        if re.search(r"^\s*(from|import) ray\b", block, re.M):
            require("ray", "pip install 'ray[serve]==2.60.0'")
        lines = block.splitlines()
        for stmt in ast.parse(block).body:
            code = "\n".join(lines[stmt.lineno - 1 : stmt.end_lineno])
            last = lines[stmt.end_lineno - 1]
            want = None
            if isinstance(stmt, ast.Expr) and "#" in last:
                try:
                    want = ast.literal_eval(last.rsplit("#", 1)[1].strip())
                except (ValueError, SyntaxError):
                    want = None
            if want is None:
                exec(compile(code, str(README), "exec"), ns)
                continue
            got = eval(compile(ast.Expression(stmt.value), str(README), "eval"), ns)
            got = tuple(got) if isinstance(got, tuple) else got
            assert got == want, f"{code.strip()}: {got!r}, the README says {want!r}"
            checked += 1
    assert checked >= 5
