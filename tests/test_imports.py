"""Every module of the project imports with only what requirements.txt installs (issue 35).

Why: a new user's first two commands install requirements.txt into a fresh interpreter; a module
that imports a package nothing installs (scipy in bench/convergence.py was one) fails on their
machine and not on one where it was installed by hand. Two checks, each naming what is missing:

* every module of megatron/, tools/, bench/, examples/ and pretrain_gpt.py imports, in a
  subprocess of this interpreter without user site-packages (CI's is a virtual environment made
  new for the run, so there it holds the requirements and nothing else);
* every third-party package imported anywhere -- also inside a function, where importing the
  module does not reach it -- is provided by a distribution that requirements.txt names, unless
  the import is guarded by an ``except ImportError`` (an optional extra such as Transformer
  Engine). This holds whatever else the interpreter has installed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["pretrain_gpt.py", "megatron/training", "megatron/distributed", "megatron/planner",
           "tools", "bench", "examples"]
OURS = {"megatron", "tools", "bench", "pretrain_gpt"}
"""Top-level names the checkout provides (``megatron`` is shared with megatron-core, which
requirements.txt names)."""
WRITTEN_BY_TESTS = {"late_rank_job"}
"""Modules a test writes itself before importing them (tests/test_dist_harness.py)."""


def project_files() -> List[Path]:
    files: List[Path] = []
    for entry in SOURCES:
        path = REPO / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def _guarded(node: ast.AST, parents: Dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` whose handlers catch a failed import (the module is optional there)."""
    optional = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if handler.type is None or any(isinstance(n, ast.Name) and n.id in optional
                                               for n in names):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def third_party_imports(path: Path, local: Set[str] = frozenset()) -> Set[str]:
    """Top-level names of the unguarded absolute imports in ``path`` that are neither the
    standard library's nor the project's (nor a script's sibling module, nor in ``local``: the
    project's scripts, which tests import with their folder on ``sys.path``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    siblings = {p.stem for p in path.parent.glob("*.py")}
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module.split(".")[0]]
        else:
            continue
        if not _guarded(node, parents):
            names |= {n for n in found if n not in sys.stdlib_module_names and n not in OURS
                      and n not in siblings and n not in local}
    return names


def required_distributions() -> Set[str]:
    names = set()
    for line in (REPO / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(_normalize(re.split(r"[\s;=<>!~\[]", line, maxsplit=1)[0]))
    return names


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Runs in the subprocess: imports each package module by its dotted name and each script as a
# module (its directory and the repository on sys.path, as when it is run), and maps each third-party name to the distributions providing it.
_PROBE = r"""
import importlib.metadata, importlib.util, json, sys, traceback
files, names, repo = json.loads(sys.argv[1])
base_path = list(sys.path)
failures = {}
for i, path in enumerate(files):
    sys.path[:] = [path.rsplit("/", 1)[0], repo] + base_path
    try:
        if path.startswith(repo + "/megatron/"):   # package modules, by their dotted name
            importlib.import_module(path[len(repo) + 1:-3].replace("/", ".")
                                    .removesuffix(".__init__"))
            continue
        spec = importlib.util.spec_from_file_location(f"_import_check_{i}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    except BaseException as exc:  # SystemExit of a script run at import counts too
        failures[path] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
providers = importlib.metadata.packages_distributions()
found = {n: (importlib.util.find_spec(n) is not None, providers.get(n, [])) for n in names}
print("RESULT " + json.dumps({"failures": failures, "found": found}))
"""


def test_every_module_imports_and_every_dependency_is_required() -> None:
    files = project_files()
    assert len(files) > 50 and (REPO / "bench" / "convergence.py") in files
    imported: Dict[str, Set[str]] = {}
    # the tests' imports too: the README's test command runs them on the same install
    tests = sorted((REPO / "tests").glob("*.py"))
    scripts = {f.stem for f in files}
    for f in files + tests:
        for name in third_party_imports(f, scripts):
            if name not in WRITTEN_BY_TESTS:
                imported.setdefault(name, set()).add(str(f.relative_to(REPO)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = subprocess.run(
        [sys.executable, "-s", "-c", _PROBE,
         json.dumps([[str(f) for f in files], sorted(imported), str(REPO)])],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(res.stdout.split("RESULT ", 1)[1])
    failures = {str(Path(p).relative_to(REPO)): e for p, e in result["failures"].items()}
    assert failures == {}, "modules that do not import:\n" + "\n".join(
        f"  {p}: {e}" for p, e in sorted(failures.items()))
    required = required_distributions()
    missing = {name: sorted(imported[name]) for name, (spec, providers) in result["found"].items()
               if not spec or not required & {_normalize(d) for d in providers}}
    assert missing == {}, (
        "imported without an `except ImportError` guard, but no distribution in requirements.txt "
        f"provides them (name: files): {missing}")


def test_the_scan_sees_imports_inside_functions_and_respects_guards(tmp_path: Path) -> None:
    """The static half finds what importing a module cannot reach, and only that."""
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nimport numpy\n"
        "def late():\n    from scipy import stats\n    return stats\n"
        "try:\n    import transformer_engine\nexcept ImportError:\n    pass\n"
        "try:\n    import apex.normalization\nexcept (RuntimeError, ModuleNotFoundError):\n    pass\n"
        "try:\n    import wandb\nexcept RuntimeError:\n    pass\n"
        "from megatron.core import parallel_state\nimport sibling\n")
    (tmp_path / "sibling.py").write_text("")
    assert third_party_imports(module) == {"numpy", "scipy", "wandb"}
    assert {"torch", "megatron-core", "scipy"} <= required_distributions()


def test_requirements_txt_mirrors_pyproject() -> None:
    """``pip install -e .`` and the README's commands install the same packages."""
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {_normalize(re.split(r"[\s;=<>!~\[]", d, maxsplit=1)[0])
                for d in project["dependencies"]}
    assert declared == required_distributions()
