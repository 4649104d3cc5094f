"""The type stubs under a type checker: ``mypy.stubtest`` finds no difference from the
compiled module beyond the allowlisted ones, and ``mypy --strict`` accepts typed code written
against the documented API and rejects code the runtime refuses."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

from conftest import HERE, require

require("mypy", "pip install mypy")


def _mypy_strict(tmp_path: pathlib.Path, code: str) -> tuple[int, str]:
    src = tmp_path / "user.py"
    src.write_text(textwrap.dedent(code))
    p = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(src)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    return p.returncode, p.stdout + p.stderr


def test_stubtest_finds_no_difference(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "kvtrie._kvtrie",
            "--ignore-disjoint-bases",
            "--allowlist",
            str(HERE / "data" / "stubtest_allowlist.txt"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not next to a source tree of kvtrie
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_typed_code_using_the_documented_api_type_checks(tmp_path):
    rc, out = _mypy_strict(
        tmp_path,
        """
        from collections.abc import Mapping

        import kvtrie

        print(kvtrie.__version__)
        tree = kvtrie.PrefixTree()
        tree.add_tenants(["a"], 0.0)
        counts: Mapping[str, int] = tree.tenant_to_char_count
        a: int | None = counts.get("a")
        b: int = tree.tenant_to_char_count.get("a", 0)
        c: int | str = tree.tenant_to_char_count.get("a", "none")
        """,
    )
    assert rc == 0, out


def test_subclassing_a_final_class_is_a_type_error(tmp_path):
    # The runtime refuses it: "type 'kvtrie.PrefixTree' is not an acceptable base type".
    rc, out = _mypy_strict(
        tmp_path,
        """
        import kvtrie

        class MyTree(kvtrie.PrefixTree):
            pass
        """,
    )
    assert rc == 1 and 'Cannot inherit from final class "PrefixTree"' in out, out
