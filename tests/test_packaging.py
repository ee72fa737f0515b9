"""Packaging guards: the wheel's package list, no bare top-level modules, torch-free layers."""

from __future__ import annotations

import re
import subprocess
import textwrap
import zipfile

import pytest

from conftest import PYTHON, REPO

PACKAGES = {"pipec", "pipec.compiler", "pipec.compiler.ir", "pipec.compiler.passes", "pipec.compiler.sim",
            "pipec.model", "pipec.tp", "pipec.costs", "pipec.tune", "pipec.views", "pipec.schedules", "pipec.runtime", "pipec.dsl", "pipec.examples"}

BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in {names}:
                raise ImportError('blocked for this test: ' + name)
            return None
    sys.meta_path.insert(0, Block())
    """
)


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_wheel_holds_only_pipec_packages(tmp_path):
    out = subprocess.run(
        [PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("pipec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top <= {"pipec", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == PACKAGES
    assert "pipec/dsl/grammar.lark" in names
    assert any(n.startswith("pipec/examples/") and n.endswith(".pipe") for n in names)


@pytest.mark.parametrize("bare", ["compiler", "schedules", "runtime", "dsl", "examples"])
def test_no_bare_top_level_modules(tmp_path, bare):
    out = _python(f"import {bare}", tmp_path)
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr


def test_dsl_and_schedules_import_without_torch(tmp_path):
    code = BLOCK_TORCH.format(names={"torch", "networkx"}) + "import pipec.dsl, pipec.schedules\nprint('ok')"
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_schedule_only_compile_imports_neither_torch_nor_networkx(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        from pipec.cli import main
        rc = main(['compile', '--schedule', 'interleaved_1f1b', '--ranks', '4', '--virtual', '2',
                   '--microbatches', '8', '-o', 'plan.json'])
        heavy = sorted(m for m in ('torch', 'networkx', 'matplotlib') if m in sys.modules)
        print(rc, heavy)
        """
    )
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"


_MODULE_NAME = re.compile(r"pipec(\.[a-z_]+)+")


def _imported_modules(path) -> set[str]:
    """Every module a source file imports, at module level or inside a function, and every module it names
    as a string (``python -m pipec.runtime.linkprobe`` started as a process is an edge too)."""
    import ast as pyast

    found: set[str] = set()
    for node in pyast.walk(pyast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, pyast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, pyast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        elif isinstance(node, pyast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            found.add(node.value)
    return found


# what each folder may not import: the compiler sits below the runtime, the search and the views; the model
# layer sits below the compiler, tp and the costs, and reads only the compiler's types (ir, request, config);
# the views draw plans and timelines and run nothing
_ABOVE_THE_TYPES = ("pipec.compiler.driver", "pipec.compiler.frontend", "pipec.compiler.passes", "pipec.compiler.sim",
                    "pipec.runtime", "pipec.dsl", "pipec.tune", "pipec.views")
FORBIDDEN = {
    "compiler": ("pipec.runtime", "pipec.dsl", "pipec.tune", "pipec.views"),
    "model": _ABOVE_THE_TYPES + ("pipec.tp", "pipec.costs"),
    "tp": _ABOVE_THE_TYPES + ("pipec.costs",),
    # the costs time what the host's contention model says (sim.contention) and start the runtime's link probe
    "costs": tuple(m for m in _ABOVE_THE_TYPES if m != "pipec.compiler.sim") + ("pipec.compiler.sim.simulate",),
    "views": ("pipec.runtime", "pipec.dsl", "pipec.tune", "pipec.costs", "pipec.tp"),
    "schedules": ("pipec.compiler", "pipec.model", "pipec.tp", "pipec.costs", "pipec.runtime", "pipec.dsl",
                  "pipec.tune", "pipec.views"),
    "runtime": ("pipec.dsl", "pipec.tune", "pipec.costs"),
}
# the one edge up a layer, each with its reason: the link probe is a torchrun job of the runtime's
ALLOWED = {"costs": ("pipec.runtime.linkprobe",)}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layering(folder):
    offenders = {
        str(path.relative_to(REPO)): sorted(m for m in _imported_modules(path)
                                            if m.startswith(FORBIDDEN[folder]) and m not in ALLOWED.get(folder, ()))
        for path in (REPO / folder).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_layering_rule_sees_imports():
    # the walker finds an import inside a function, so the rule above can fail
    found = _imported_modules(REPO / "compiler" / "driver.py")
    assert "pipec.compiler.frontend" in found and "pipec.schedules" in found
    # and a module named as a string, started as a process
    assert "pipec.runtime.linkprobe" in _imported_modules(REPO / "costs" / "links.py")


def test_only_the_front_end_imports_torch_at_module_level(tmp_path):
    modules = sorted(
        "pipec.compiler." + ".".join(p.relative_to(REPO / "compiler").with_suffix("").parts).removesuffix(".__init__")
        for p in (REPO / "compiler").rglob("*.py") if p.stem != "frontend")
    modules = [m.removesuffix(".") if m != "pipec.compiler." else "pipec.compiler" for m in modules]
    code = BLOCK_TORCH.format(names={"torch"}) + "import importlib\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules) + "print('ok')"
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(modules) > 15 and out.stdout.strip() == "ok"


def test_pipe_split_is_exported_and_import_pipec_imports_no_torch(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import pipec
        assert "torch" not in sys.modules, "import pipec imported torch"
        from pipec import pipe_split
        from pipec.model.trace import pipe_split as marker
        assert pipe_split is marker and "pipe_split" in pipec.__all__
        try:
            pipec.no_such_name
        except AttributeError as err:
            print("ok", err)
        """
    )
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok module 'pipec' has no attribute 'no_such_name'"
