"""Data-parallel training: the ranks, how they find each other, and how they talk.

R processes (ranks), one a GPU, each hold the whole model. Every step each rank runs forward
and backward on its own shard of the batch (data.BatchSampler's `shard`), the ranks average
their gradients, and each applies the same AdamW step, so the parameters stay equal
everywhere. Averaging is the sum over ranks of gradients already scaled by 1/R (the loss's
gradient in step.py is 1/(grad_accum * R)), so a communicator needs only a sum.

    Communicator      all_reduce(arrays)        each array = its sum over the ranks, in place
                      all_gather(array, bounds)  rank r's array[b_r:b_r+1] to every rank
        NcclCommunicator    device arrays, through cupy.cuda.nccl, on the launching stream
        SocketCommunicator  NumPy arrays, through rank 0 over TCP (the CPU backend; tests)
    GradientBuckets   which contiguous ranges of the flat gradient buffer (params.py) are
                      averaged together, and when: a layer's bucket as soon as backward has
                      written the last of its gradients, while the layers below still run
    Rendezvous        TCP connections from every rank to rank 0 at MASTER_ADDR:MASTER_PORT:
                      small broadcasts (NCCL's unique id), barriers, the socket
                      communicator's data, and the watchdog's heartbeats

Who starts the ranks (`world_from_environment`):
    train --gpus N    this module's `start_ranks`: N fresh interpreters (never a fork of one that
                      has touched CUDA) with the variables torchrun sets
    torchrun          RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (the rendezvous
                      listens on MASTER_PORT + 1: torchrun's own store holds MASTER_PORT)
    mpirun / srun     mpi4py's rank and size, rank 0's address and NCCL's id broadcast over
                      MPI; without mpi4py, Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
                      with MASTER_ADDR and MASTER_PORT set by the job script

Failure: a rank that exits or stops answering must not leave the others waiting forever in a
collective. Every rank sends rank 0 a heartbeat every second and rank 0 answers in kind; a
connection that closes without a goodbye, or stays silent for the timeout (train
--rank-timeout, 60 s), ends every rank with one line, from rank 0 (rank 1 if rank 0 is the
one gone), naming the rank. Checkpoints are written atomically, so the last one is whole.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from . import schedule
from .kernels.runtime import launch
from .stops import Terminated

DEFAULT_TIMEOUT = 60.0
HEARTBEAT_SECONDS = 1.0


class DistributedError(RuntimeError):
    """The ranks cannot start or go on together; the message names the rank."""


# --- frames over TCP: an 8-byte length, then the bytes ----------------------------------------

def send_frame(sock, payload):
    """payload: bytes, or a memoryview of a contiguous array (sent as its bytes)."""
    payload = memoryview(payload).cast("B")
    sock.sendall(struct.pack("<Q", len(payload)))
    if len(payload):
        sock.sendall(payload)


def recv_into(sock, view):
    """Fill `view` (a writable memoryview of bytes) from sock; False if the peer closed."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def recv_frame(sock, into=None):
    """The next frame's bytes (None if the peer closed); into: a writable buffer of exactly
    the frame's size, filled in place (a NumPy array's memory)."""
    header = bytearray(8)
    if not recv_into(sock, memoryview(header)):
        return None
    size = struct.unpack("<Q", header)[0]
    target = memoryview(bytearray(size) if into is None else into).cast("B")
    if len(target) != size:
        raise DistributedError(f"a frame of {size} bytes, expected {len(target)}")
    if not recv_into(sock, target):
        return None
    return target.obj if into is None else into


# --- the ranks' connections to rank 0 ---------------------------------------------------------

@dataclass
class Address:
    host: str
    port: int


class Rendezvous:
    """Rank 0 listens; every other rank opens two connections to it: `data` (broadcasts,
    barriers, the socket communicator) and `watch` (the heartbeats, Watchdog)."""

    def __init__(self, rank, size, address, timeout=DEFAULT_TIMEOUT):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.data, self.watch = {}, {}          # peer rank -> socket (on rank 0: every rank)
        if size == 1:
            return
        if rank == 0:
            self._accept(address)
        else:
            for kind in ("data", "watch"):
                sock = self._connect(address)
                send_frame(sock, json.dumps({"rank": rank, "kind": kind}).encode())
                getattr(self, kind)[0] = sock

    def _accept(self, address):
        server = socket.create_server(("", address.port), reuse_port=False)
        server.settimeout(self.timeout)
        deadline = time.monotonic() + self.timeout
        try:
            while len(self.data) + len(self.watch) < 2 * (self.size - 1):
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    arrived = sorted(set(self.data) & set(self.watch))
                    raise DistributedError(
                        f"rank 0: {len(arrived) + 1} of {self.size} ranks arrived within "
                        f"{self.timeout:.0f} s on port {address.port} (missing: "
                        f"{', '.join(str(r) for r in range(1, self.size) if r not in arrived)})"
                    ) from None
                sock.settimeout(self.timeout)
                hello = json.loads(recv_frame(sock).decode())
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                getattr(self, hello["kind"])[hello["rank"]] = sock
        finally:
            server.close()

    def _connect(self, address):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = socket.create_connection((address.host, address.port), timeout=5)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError:
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"rank {self.rank}: could not reach rank 0 at {address.host}:"
                        f"{address.port} within {self.timeout:.0f} s") from None
                time.sleep(0.1)

    def peers(self):
        return sorted(self.data)

    def exchange(self, payload, combine):
        """Every rank sends rank 0 `payload` (bytes); rank 0 makes one answer of them all,
        combine([payload of rank 0, 1, ...]) -> bytes, and every rank gets it back."""
        if self.size == 1:
            return combine([payload])
        if self.rank != 0:
            send_frame(self.data[0], payload)
            return self._received(self.data[0], 0)
        parts = [payload] + [self._received(self.data[peer], peer) for peer in self.peers()]
        answer = combine(parts)
        for peer in self.peers():
            send_frame(self.data[peer], answer)
        return answer

    def _received(self, sock, peer, into=None):
        try:
            frame = recv_frame(sock, into)
        except OSError:
            frame = None
        if frame is None:
            raise DistributedError(f"rank {peer} exited (its connection closed)")
        return frame

    def broadcast(self, payload=b""):
        """Rank 0's payload, on every rank."""
        return self.exchange(payload if self.rank == 0 else b"", lambda parts: parts[0])

    def barrier(self):
        self.exchange(b"", lambda parts: b"")

    def close(self):
        for sock in [*self.data.values(), *self.watch.values()]:
            sock.close()


# --- the communicators ------------------------------------------------------------------------

class SocketCommunicator:
    """Sums and gathers NumPy arrays through rank 0: each rank sends its array, rank 0 adds
    them in rank order (so every run adds alike) and sends the result back. The CPU backend's
    communicator: the same calls as NCCL's, for tests and CPU runs, not for speed."""

    capturable = True           # (nothing to capture: the NumPy backend has no graphs)

    def __init__(self, rendezvous):
        self.rendezvous = rendezvous
        self.rank, self.size = rendezvous.rank, rendezvous.size

    def all_reduce(self, arrays):
        for array in arrays:
            self._all_reduce(array)

    def _all_reduce(self, array):
        r = self.rendezvous
        if self.size == 1:
            return
        if self.rank != 0:
            send_frame(r.data[0], array)
            r._received(r.data[0], 0, into=array)
            return
        received = np.empty_like(array)
        for peer in r.peers():                  # (array += rank 1's, then rank 2's, ...)
            array += r._received(r.data[peer], peer, into=received)
        for peer in r.peers():
            send_frame(r.data[peer], array)

    def all_gather(self, array, bounds):
        r = self.rendezvous
        if self.size == 1:
            return
        if self.rank != 0:
            send_frame(r.data[0], array[bounds[self.rank]:bounds[self.rank + 1]])
            r._received(r.data[0], 0, into=array)
            return
        for peer in r.peers():
            r._received(r.data[peer], peer, into=array[bounds[peer]:bounds[peer + 1]])
        for peer in r.peers():
            send_frame(r.data[peer], array)


class NcclCommunicator:
    """Sums and gathers float32 device arrays with NCCL (cupy.cuda.nccl), on the stream the
    kernels are launched to (kernels/runtime/launch.current_stream), so inside a captured step the
    collectives are part of the CUDA graph (NCCL 2.9 and later may be captured). Several
    arrays are one NCCL group: one launch. While kernels are only being recorded (precompile)
    nothing is sent."""

    CAPTURABLE_FROM = 20906     # NCCL 2.9.6: collectives may be captured in a CUDA graph

    def __init__(self, rank, size, broadcast):
        try:
            from cupy.cuda import nccl
            nccl.get_version()
        except Exception as error:
            raise DistributedError(f"rank {rank}: CuPy has no NCCL ({error}): pip install "
                                   f"nvidia-nccl-cu12 (CUDA 12) or nvidia-nccl-cu13") from None
        self.nccl, self.rank, self.size = nccl, rank, size
        self.capturable = nccl.get_version() >= self.CAPTURABLE_FROM
        unique_id = nccl.get_unique_id() if rank == 0 else None
        payload = broadcast(bytes(b & 0xFF for b in unique_id) if rank == 0 else b"")
        try:                    # CuPy 14 takes the id's 128 bytes; older CuPy a tuple of
            self.comm = nccl.NcclCommunicator(size, payload, rank)      # signed chars
        except TypeError:
            self.comm = nccl.NcclCommunicator(
                size, tuple(b - 256 if b > 127 else b for b in payload), rank)

    @staticmethod
    def _pointer(array):
        return array.__cuda_array_interface__["data"][0]

    @staticmethod
    def _stream():
        return None if launch.is_recording() else int(launch.current_stream())

    def all_reduce(self, arrays):
        stream = self._stream()
        if stream is None:
            return
        nccl = self.nccl
        nccl.groupStart()
        for array in arrays:
            pointer = self._pointer(array)
            self.comm.allReduce(pointer, pointer, array.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                stream)
        nccl.groupEnd()

    def all_gather(self, array, bounds):
        """A broadcast of each rank's shard from that rank, grouped: an all-gather whose
        shards may differ in size."""
        stream = self._stream()
        if stream is None:
            return
        nccl, base = self.nccl, self._pointer(array)
        nccl.groupStart()
        for root in range(self.size):
            lo, hi = bounds[root], bounds[root + 1]
            self.comm.bcast(base + 4 * lo, hi - lo, nccl.NCCL_FLOAT32, root, stream)
        nccl.groupEnd()

    def abort(self):
        self.comm.abort()


# --- which gradients are averaged together, and when ------------------------------------------

class GradientBuckets:
    """The flat gradient buffer in buckets, one a layer (last layer first, the order backward
    finishes them) and a last one of the rest (the token and position embeddings, which
    backward finishes last, and ln_f). A bucket is the contiguous ranges of the buffer its
    parameters fill, all-reduced together as one NCCL group as soon as backward has run
    every node that writes one of its gradients, beside the rest of backward on the step's
    second stream (schedule.on_second_stream): the layers below compute while a layer's gradients
    travel. Without a second stream (the CPU, an eager GPU step) the same calls run in line."""

    def __init__(self, store, communicator):
        self.store, self.communicator = store, communicator
        groups = {}
        for spec in store.layout:
            layer = int(spec.name.split(".")[1]) if spec.name.startswith("h.") else -1
            groups.setdefault(layer, []).append(spec.name)
        order = sorted((layer for layer in groups if layer >= 0), reverse=True) + [-1]
        self.names = [groups[layer] for layer in order]
        self.ranges = [self._ranges(names) for names in self.names]
        self.launched = [False] * len(self.names)
        self.bucket_of, self.waiting = {}, []

    def _ranges(self, names):
        spans = sorted((self.store.offsets[n], self.store.offsets[n] + self.store[n].data.size)
                       for n in names)
        merged = [list(spans[0])]
        for start, end in spans[1:]:
            if start - merged[-1][1] < 4:       # (the alignment gap between two views)
                merged[-1][1] = end
            else:
                merged.append([start, end])
        return [tuple(span) for span in merged]

    def arm(self, tape_inputs):
        """Before the last micro-batch's backward: count, for each bucket, the tape nodes that
        write one of its gradients (tape_inputs: autograd.recorded())."""
        self.bucket_of = {id(self.store[name]): b for b, names in enumerate(self.names)
                          for name in names}
        self.waiting = [0] * len(self.names)
        for inputs in tape_inputs:
            for tensor in inputs:
                bucket = self.bucket_of.get(id(tensor))
                if bucket is not None:
                    self.waiting[bucket] += 1

    def after_node(self, inputs):
        """autograd's after_node: a node is done; launch the buckets it completes."""
        for tensor in inputs:
            bucket = self.bucket_of.get(id(tensor))
            if bucket is not None:
                self.waiting[bucket] -= 1
                if self.waiting[bucket] == 0:
                    self.launch(bucket)

    def launch(self, bucket):
        grads = self.store.grads
        with schedule.on_second_stream():
            self.communicator.all_reduce([grads[start:end] for start, end in self.ranges[bucket]])
        self.launched[bucket] = True

    def finish(self, loss):
        """After backward: the buckets not launched yet (all of them when communication runs
        after the graph), then the step's loss summed over the ranks."""
        for bucket, done in enumerate(self.launched):
            if not done:
                self.launch(bucket)
        with schedule.on_second_stream():
            self.communicator.all_reduce([loss])
        schedule.join()
        self.launched = [False] * len(self.names)


def data_parallel(store, communicator, zero1=False, **hyperparameters):
    """(optimizer, buckets) for a data-parallel TrainStep over the model's store: AdamW, or
    under ZeRO-1 optim.ShardedAdamW (the store then made without m and v), and the gradient
    buckets the step all-reduces."""
    from .optim import AdamW, ShardedAdamW
    optimizer = (ShardedAdamW(store, communicator, **hyperparameters) if zero1 else
                 AdamW(store, **hyperparameters))
    return optimizer, GradientBuckets(store, communicator)


# --- the world: who this process is among the ranks ----------------------------------------------

class World:
    """This process's rank among `size`, its connections, its communicator and watchdog."""

    def __init__(self, rank, size, local_rank, address, timeout=DEFAULT_TIMEOUT, mpi=None):
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.timeout, self.mpi = timeout, mpi
        self.rendezvous = Rendezvous(rank, size, address, timeout)
        self.watchdog = Watchdog(self) if size > 1 else None
        self.communicator = None

    @property
    def main(self):
        return self.rank == 0

    def select_device(self):
        """Make GPU local_rank this process's device, before anything else touches CUDA (GPU
        0 when the launcher shows each rank one GPU, as Slurm's --gpus-per-task does)."""
        import cupy
        from numba import cuda
        visible = len(cuda.gpus)
        if self.local_rank >= visible > 1:
            raise DistributedError(f"rank {self.rank}: its local rank is {self.local_rank} but "
                                   f"this host shows {visible} GPUs (fewer ranks a host)")
        device = 0 if visible == 1 else self.local_rank
        cuda.select_device(device)
        cupy.cuda.Device(device).use()

    def connect(self, backend):
        """The communicator for `backend`: NCCL on the GPU, sockets on the CPU."""
        if backend.name == "cuda":
            broadcast = (self.mpi.bcast if self.mpi is not None else self.rendezvous.broadcast)
            self.communicator = NcclCommunicator(self.rank, self.size, broadcast)
        else:
            self.communicator = SocketCommunicator(self.rendezvous)
        return self.communicator

    def fail(self, message):
        """This rank cannot go on: tell rank 0 (rank 0: every rank), then stop."""
        if self.watchdog is None:
            raise DistributedError(message)
        self.watchdog.stop_everyone(f"rank {self.rank}: {message}", origin=self.rank)

    def close(self):
        """A clean end: wait for every rank, say goodbye, close the connections."""
        if self.size > 1:
            self.rendezvous.barrier()
            self.watchdog.goodbye()
        self.rendezvous.close()


class Watchdog:
    """Heartbeats between rank 0 and every other rank, on the `watch` connections; a threads'
    affair, so a rank waiting in a collective (or computing) is still heard. On a failure:
    one line on stderr, from the rank that can name the culprit, and every rank exits."""

    def __init__(self, world):
        self.world = world
        self.locks = {peer: threading.Lock() for peer in world.rendezvous.watch}
        self.finished = set()            # peers that said goodbye
        self.stopping = threading.Lock()
        for peer, sock in world.rendezvous.watch.items():
            sock.settimeout(world.timeout)
            threading.Thread(target=self._listen, args=(peer, sock), daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _send(self, peer, payload):
        try:
            with self.locks[peer]:
                send_frame(self.world.rendezvous.watch[peer], payload)
        except OSError:
            pass                          # (its listener reports it)

    def _beat(self):
        while True:
            for peer in list(self.locks):
                if peer not in self.finished:
                    self._send(peer, b"h")
            time.sleep(HEARTBEAT_SECONDS)

    def _listen(self, peer, sock):
        world = self.world
        while True:
            try:
                frame = recv_frame(sock)
            except socket.timeout:
                frame = f"stopped responding (silent for {world.timeout:.0f} s)"
            except OSError:
                frame = None
            if frame is None:
                frame = "exited (its connection closed)"
            if isinstance(frame, str):
                if peer in self.finished:
                    return
                self.stop_everyone(f"rank {peer} {frame}", origin=peer)
            if frame == b"b":
                self.finished.add(peer)
                return
            if frame.startswith(b"a"):              # a failure another rank has seen
                self.stop_everyone(frame[1:].decode(), origin=peer, told=True)

    def stop_everyone(self, message, origin, told=False):
        """Rank 0 tells every other rank and says `message`; another rank tells rank 0 (which
        says it), or, when rank 0 is the one gone, rank 1 says it. Then this process exits."""
        with self.stopping:
            world = self.world
            if world.rank == 0:
                for peer in self.locks:
                    if peer != origin:
                        self._send(peer, b"a" + message.encode())
                say = True
            elif not told and origin != 0:
                self._send(0, b"a" + message.encode())
                say = False
            else:
                say = origin == 0 and not told and world.rank == 1
            if say:
                print(f"Error: {message}; stopping every rank", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)

    def goodbye(self):
        for peer in list(self.locks):
            self.finished.add(peer)
            self._send(peer, b"b")


# --- who starts the ranks -------------------------------------------------------------------------

def world_from_environment(timeout=DEFAULT_TIMEOUT, environ=None):
    """The World this process belongs to, from what its launcher set; None when nothing says
    there are several ranks (a plain `nanoandrea train`)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:            # train --gpus, torchrun
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        port = int(_required(env, "MASTER_PORT", "RANK"))
        if env.get("TORCHELASTIC_RUN_ID"):              # (torchrun's store is on MASTER_PORT)
            port += 1
        return World(rank, size, local_rank, Address(_required(env, "MASTER_ADDR", "RANK"),
                                                     port), timeout)
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        try:
            from mpi4py import MPI
        except ImportError:
            MPI = None
        if MPI is not None:
            return _world_from_mpi(MPI.COMM_WORLD, env, timeout)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        rank = int(env["SLURM_PROCID"])
        address = Address(_required(env, "MASTER_ADDR", "SLURM_PROCID"),
                          int(_required(env, "MASTER_PORT", "SLURM_PROCID")))
        return World(rank, int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), address,
                     timeout)
    if "OMPI_COMM_WORLD_SIZE" in env:
        raise DistributedError("mpirun: install mpi4py (pip install mpi4py), or set RANK, "
                               "WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank")
    return None


def _required(env, name, because):
    if name not in env:
        raise DistributedError(f"{because} is set but {name} is not: set {name} for every rank")
    return env[name]


def _world_from_mpi(comm, env, timeout):
    """Rank and size from MPI; rank 0's address for the rendezvous broadcast over MPI."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()     # (rank on this host)
    address = None
    if rank == 0:           # (a name the other hosts resolve; 127.0.1.1 is this host's alone)
        address = Address(env.get("MASTER_ADDR") or socket.getfqdn(),
                          int(env.get("MASTER_PORT") or _free_port()))
    address = comm.bcast(address, root=0)
    return World(rank, size, local_rank, address, timeout, mpi=comm)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_ranks(size, arguments, timeout=DEFAULT_TIMEOUT, environ=None, program=None):
    """train --gpus N: N fresh processes `python -m nanoandrea train ARGUMENTS` with the
    variables torchrun would set (ranks 0..N-1 on this host, GPU r for rank r), importing
    this same nanoandrea. Returns the
    exit status: 0 when every rank succeeded. When one fails the others stop by themselves
    (their watchdogs); any still running a timeout later are ended."""
    port = _free_port()
    base = dict(os.environ if environ is None else environ, WORLD_SIZE=str(size),
                LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, base.get("PYTHONPATH")]))
    program = program or [sys.executable, "-m", "nanoandrea", "train"]
    ranks = [subprocess.Popen(program + list(arguments),
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(size)]
    deadline = None
    while True:
        try:
            codes = [p.poll() for p in ranks]
            if all(code is not None for code in codes):
                return next((code for code in codes if code), 0)
            if deadline is None and any(code for code in codes if code is not None):
                deadline = time.monotonic() + timeout + 10
            if deadline is not None and time.monotonic() > deadline:
                for p in ranks:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
        except KeyboardInterrupt as stop:
            # Ctrl-C reaches every rank from the terminal, and they say it once; SIGTERM (a
            # job scheduler's stop, stops.Terminated) reached this process alone: rank 0 is
            # sent it, and stops every rank with one line naming its last checkpoint
            if isinstance(stop, Terminated) and ranks[0].poll() is None:
                ranks[0].send_signal(signal.SIGTERM)
            deadline = deadline or time.monotonic() + timeout + 10
