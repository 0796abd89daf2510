import sys, time, cProfile, pstats
sys.path.insert(0, '.'); sys.path.insert(0, './tools')
from numba import cuda
import kernel_report as kr
from nanoandrea.kernels import matmul
k = matmul._blocked_kernel(False, False, (True, True, True))
t = time.perf_counter()
pr = cProfile.Profile(); pr.enable()
ptx, _ = cuda.compile_ptx(k.py_func, kr.MATMUL_ARGS, cc=(9, 0))
pr.disable()
print("compile_ptx NN", time.perf_counter() - t, "s", len(ptx))
st = pstats.Stats(pr); st.sort_stats('cumulative').print_stats(25)
