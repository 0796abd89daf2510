"""Named barriers: a barrier for some of a block's warps, not all (PTX `bar.sync`, `bar.arrive`).

    barrier_sync(b, count)      wait at barrier b (1 .. 15) until `count` threads, this one
                                among them, have reached it (by barrier_sync or barrier_arrive)
    barrier_arrive(b, count)    count this thread as arrived at barrier b, and go on at once

cuda.syncthreads() is barrier 0 for every thread of the block. A block whose warpgroups do
different work at the same time (v19's: the producer copies while each consumer stores its
rows of a tile) cannot use it: each warpgroup meets its own threads at a barrier of its own
(barrier_sync(group, 128)). `count` is a multiple of 32, and every thread of a warp takes the
same barrier instruction. (The package's kernels need none: each kernel's warpgroups meet at
syncthreads or at mbarriers. Commit 1f51de6 had this module in the package, for a ping-pong
matmul that was measured slower and reverted.) Like syncthreads, bar.sync also orders the shared-memory accesses of the threads
it meets.

On the GPU these are inline PTX (`bar.sync b, count;`, `bar.arrive b, count;`). Under the
simulator, whose threads are Python threads, each (block, b) is a counter with a condition:
the count-th arrival releases the waiters and starts the barrier's next use.
"""
from nanoandrea.kernels.launch import SIMULATOR

if SIMULATOR:
    import threading

    from numba import cuda

    class _Barrier:
        def __init__(self):
            self.arrived, self.generation = 0, 0
            self.condition = threading.Condition()

    _barriers, _lock = {}, threading.Lock()

    def _arrive(block, b, count, wait):
        with _lock:
            barrier = _barriers.setdefault((block, int(b)), _Barrier())
        with barrier.condition:
            generation = barrier.generation
            barrier.arrived += 1
            if barrier.arrived == count:
                barrier.arrived, barrier.generation = 0, generation + 1
                barrier.condition.notify_all()
            elif wait and not barrier.condition.wait_for(
                    lambda: barrier.generation != generation, timeout=120):
                raise RuntimeError(f"barrier {b}: {barrier.arrived} of {count} threads "
                                   "arrived in 120 s")

    # (device functions, so that `cuda` in them is the simulated one: the simulator swaps it
    # in the globals of the kernel's module and of each device function it calls)
    @cuda.jit(device=True)
    def barrier_sync(b, count):
        _arrive(tuple(cuda.blockIdx), b, count, wait=True)

    @cuda.jit(device=True)
    def barrier_arrive(b, count):
        _arrive(tuple(cuda.blockIdx), b, count, wait=False)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    I32 = ir.IntType(32)

    def _barrier(text):
        @intrinsic
        def barrier(typingctx, b, count):
            if not all(isinstance(x, types.Integer) for x in (b, count)):
                return None

            def codegen(context, builder, signature, args):
                values = [context.cast(builder, value, kind, types.int32)
                          for value, kind in zip(args, signature.args)]
                function = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I32, I32]), text,
                                        "r,r,~{memory}", side_effect=True)
                builder.call(function, values)

            return types.void(b, count), codegen
        return barrier

    barrier_sync = _barrier("bar.sync $0, $1;")
    barrier_arrive = _barrier("bar.arrive $0, $1;")
