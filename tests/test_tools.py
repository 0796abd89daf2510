"""Every script in tools/ still runs: each answers --help (in the simulator, without a GPU),
each module the scripts share imports, the shell scripts parse. The ladder's versions are
tests/test_dev_ladder.py's."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
LADDER = (TOOLS / "dev" / "matmul", TOOLS / "dev" / "attention")


def is_script(path):
    """Whether the file runs as a program (an `if __name__ == "__main__":` at its top)."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text()).body)


PYTHON = sorted(path for path in TOOLS.rglob("*.py")
                if not any(folder in path.parents for folder in LADDER))
SCRIPTS = [path for path in PYTHON if is_script(path)]
MODULES = [path for path in PYTHON if not is_script(path)]


def run(command, **kwargs):
    environment = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300, **kwargs)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(TOOLS)))
def test_script_answers_help(path):
    done = run([sys.executable, str(path), "--help"])
    assert done.returncode == 0 and "usage:" in done.stdout, (done.stdout + done.stderr)[-3000:]


def importable(path):
    """(the name a module is imported by, the folder its users put on sys.path)."""
    if (path.parent / "__init__.py").exists():          # a package's: benchmarks.timing
        name = path.parent.name + ("" if path.stem == "__init__" else "." + path.stem)
        return name, path.parent.parent
    return path.stem, path.parent                       # a module beside its users


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(TOOLS)))
def test_shared_module_imports(path):
    """The modules without a program of their own (the benchmark's sections, the PyTorch GPT)
    import as their users import them."""
    name, folder = importable(path)
    done = run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(folder)!r}); "
                                      f"import {name}"])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


@pytest.mark.parametrize("path", sorted(TOOLS.rglob("*.sh")), ids=lambda path: path.name)
def test_shell_script_parses(path):
    done = run(["bash", "-n", str(path)])
    assert done.returncode == 0, done.stderr
