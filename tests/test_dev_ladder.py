"""The optimisation ladder's teaching versions (tools/dev/<op>/v<N>_*.py), one test a version:
each checked against float64 NumPy at a tiny size by the driver's own check (tools/dev/run.py),
its outputs poisoned with NaN first.

Sizes: attention at the driver's simulator shape (1, 2, 40, 32); matmul at 40 x 24 x 20,
rounded up to what each version takes (its MULTIPLE_OF): the naive and shared-tile versions
run there (edges inside a tile), the register-blocked ones at 128 x 128 x 32 (one block tile,
four K slices) or 128 x 256 x 32. At 128 x 128 the one-thread-an-element versions would take
10-20 s each in the simulator.
"""
import importlib.util
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
