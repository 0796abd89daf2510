"""The optimisation ladder's teaching versions (tools/dev/<op>/v<N>_*.py), one test a version:
each checked against float64 NumPy at a tiny size by the driver's own check (tools/dev/run.py),
its outputs poisoned with NaN first.

Sizes: attention at the driver's simulator shape (1, 2, 40, 32); matmul at 40 x 24 x 20,
rounded up to what each version takes (its MULTIPLE_OF): the naive and shared-tile versions
run there (edges inside a tile), the register-blocked ones at 128 x 128 x 32 (one block tile,
four K slices) or 128 x 256 x 32. At 128 x 128 the one-thread-an-element versions would take
10-20 s each in the simulator.

Then what keeps the ladder readable: each version stands alone (the package's PTX layer and
runtime, never another version), its header has one line of what it measured, and the
driver's results table (run.py --json, --table) has its format.
"""
import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from conftest import GPU

RUN_PATH = Path(__file__).resolve().parents[1] / "tools" / "dev" / "run.py"
_spec = importlib.util.spec_from_file_location("dev_run", RUN_PATH)
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)

MATMUL_SHAPE = (40, 24, 20)


def check(op, path, shape, rng):
    module = run.load(path)
    shape = op.nearest(module, shape)
    errors = op.check(module, shape, rng)
    assert max(errors.values()) < op.tolerance(module), f"{path.stem} at {shape}: {errors}"


@pytest.mark.parametrize("path", run.versions("matmul"), ids=lambda path: path.stem)
def test_matmul_version(rng, path):
    check(run.Matmul, path, MATMUL_SHAPE, rng)


@pytest.mark.parametrize("path", run.versions("attention"), ids=lambda path: path.stem)
def test_attention_version(rng, path):
    check(run.Attention, path, run.Attention.simulator_shape, rng)


@pytest.mark.parametrize("op,path", [(op, path) for op in (run.Matmul, run.Attention)
                                     for path in run.versions(op.name)],
                         ids=lambda x: getattr(x, "stem", getattr(x, "name", "")))
def test_version_launches_are_recorded(op, path):
    """What the driver compiles ahead on a GPU (precompile_all): each version's launches,
    recorded and not made, at least one kernel, none run."""
    from nanoandrea.precompile import kernels_of
    module = run.load(path)
    shape = op.nearest(module, op.simulator_shape)
    launched = kernels_of(lambda: op.call(module, shape))
    assert launched and all(isinstance(types, tuple) for _, types in launched)


@pytest.mark.parametrize("stem", ["v17_wgmma_producer", "v18_wgmma_tma",
                                  "v19_wgmma_tma_store", "v20_wgmma_registers"])
def test_producer_versions_run_their_stages_round(rng, stem):
    """v17's to v20's mbarrier pipelines through more slices than stages and more
    than one tile a block (the simulator's one resident block takes both of its tiles; on
    the GPU about two a block): each stage's barriers go through several phases, the
    producer runs on into the block's next tile while the consumers store the last, and
    v19's and v20's consumers take their two box buffers round more than once."""
    path = next(p for p in run.versions("matmul") if p.stem == stem)
    check(run.Matmul, path, (4096, 2048, 512) if GPU else (256, 256, 192), rng)


# The versions that call the package's launchers: those that are the package's kernel today,
# and the backward versions whose forward is the package's (v3's)
PACKAGE_LAUNCHERS = {"matmul": {"v6_product", "v21_wgmma_every_product"},
                     "attention": {"v3_register_tiles", "v4_dq_kernel", "v5_dq_shares",
                                   "v6_dq_atomic", "v9_bf16_package", "v11_wgmma_package"}}
STANDARD = ("math", "typing", "numpy", "numba", "llvmlite")


def imported_modules(path):
    """Every module the version's source imports, at any depth (its simulator branches too)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module


@pytest.mark.parametrize("op,path", [(op, path) for op in ("matmul", "attention")
                                     for path in run.versions(op)],
                         ids=lambda x: getattr(x, "stem", x))
def test_version_stands_alone(op, path):
    """A version imports the package's PTX layer and runtime, never another version or a helper
    beside it; the package's kernels' launchers only where it is (or wraps) the package's."""
    allowed = ("nanoandrea.kernels.ptx", "nanoandrea.kernels.runtime")
    if path.stem in PACKAGE_LAUNCHERS[op]:
        allowed += ("nanoandrea.kernels.matmul", "nanoandrea.kernels.attention",
                    "nanoandrea.kernels.operands")
    for module in imported_modules(path):
        assert module.split(".")[0] in STANDARD or module.startswith(allowed), \
            f"{path.stem} imports {module}"


@pytest.mark.parametrize("op,path", [(op, path) for op in ("matmul", "attention")
                                     for path in run.versions(op)],
                         ids=lambda x: getattr(x, "stem", x))
def test_version_header_has_one_measured_line(op, path):
    """The docstring's first line is the idea (the table's), its second the one line of what
    was measured: 'GPU date: ratio ...', or 'not measured'; then a blank line."""
    lines = ast.get_docstring(ast.parse(path.read_text()), clean=False).split("\n")
    assert lines[0] and len(lines) > 2 and lines[2] == "", lines[:3]
    assert re.fullmatch(r"(H100|H200) \d{4}-\d\d-\d\d: .*\d\.\d\dx .*|not measured", lines[1]), \
        lines[1]


def test_results_table_from_a_run(tmp_path):
    """run.py --json writes one run (in the simulator checked, not timed; on a GPU timed, a
    ratio a version) and --table prints it as tools/dev/README.md's markdown table, a row a
    version."""
    results = tmp_path / "results.json"
    run.main(["matmul", "--only", "v1,v2", "--shape", "8,8,8", "--json", str(results)])
    lines = run.markdown_table(json.loads(results.read_text()))
    assert lines[2] == "| version | idea | ratio to cuBLAS or SDPA | GPU | date |"
    rows = lines[4:]
    assert [row.split(" | ")[0] for row in rows] == ["| matmul v1_naive",
                                                    "| matmul v2_shared_tiles"]
    if GPU:
        assert all(row.count(" | ") == 4 and re.search(r"\| [0-9.]+x", row) for row in rows)
    else:
        assert all(row.count(" | ") == 4 and "not timed" in row and "simulator" in row
                   for row in rows)


def test_results_table_says_each_ratio():
    """A timed run's passes as the table says them (the numbers here are made up: the
    simulator times nothing): a matmul's orientations beside its plain product, an
    attention version's forward beside its forward + backward."""
    def rows(version, passes):
        return [dict(version=version, idea=f"{version}'s idea", ok=True, note="",
                     **{"pass": name, "ratio": ratio}) for name, ratio in passes]
    results = dict(device="NVIDIA H100 80GB HBM3", date="2026-12-08", timed=True, ops=dict(
        matmul=dict(shape=[16384, 3072, 768], rows=rows("v1_naive", [("", 0.031)])
                    + rows("v21_wgmma", [("bf16", 0.8), ("bf16 b^T", 0.79), ("bf16 a^T", 0.78)])
                    + rows("cuBLAS", [("", 1.0)])),
        attention=dict(shape=[16, 12, 1024, 64], rows=rows("v5", [("fwd", 1.03),
                                                                  ("fwd+bwd", 0.99)])
                       + rows("v11", [("bf16 fwd", 0.86), ("bf16 fwd+bwd", 0.96)])
                       + rows("v7", [("fwd", 1.34)]))))
    table = run.markdown_table(results)
    assert table[0].startswith("matmul at 16384x3072x768, attention at 16x12x1024x64")
    cells = {row.split(" | ")[0][2:]: row.split(" | ")[2] for row in table[4:]}
    assert cells == {"matmul v1_naive": "0.03x cuBLAS float32",
                     "matmul v21_wgmma": "0.80x cuBLAS bf16 (b^T 0.79x, a^T 0.78x)",
                     "attention v5": "fwd+bwd 0.99x SDPA float32 (fwd 1.03x)",
                     "attention v11": "fwd+bwd 0.96x SDPA bf16 (fwd 0.86x)",
                     "attention v7": "fwd 1.34x SDPA float32"}
    assert all(row.endswith("| NVIDIA H100 80GB HBM3 | 2026-12-08 |") for row in table[4:])
