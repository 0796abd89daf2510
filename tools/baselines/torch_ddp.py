"""PyTorch's DistributedDataParallel training the same GPT-2 model: the baseline of the
several-GPU measurements, started the way its users start it.

    torchrun --nproc_per_node 2 tools/baselines/torch_ddp.py --preset andrea-120m \
        --batch-size 16 --block-size 1024 --precision bf16      # B a rank, as `nanoandrea
                                                                 # train` is given B x 2

Each rank trains torch_gpt.TorchGPT, nanoGPT's GPT-2 (SDPA attention, fused AdamW on a GPU),
under DDP, NCCL on GPUs and gloo on the CPU, bf16 autocast or float32, on random tokens (what
tools/bench.py's end-to-end case feeds both models). After the warm-up steps, `--steps` steps
are timed between two synchronisations; rank 0 prints the global tokens a second, and every
rank a checksum of its parameters (DDP keeps them equal: the lines must agree).
NCCL_NVLS_ENABLE=0 is set here as on every run of this project (NVLink multicast stays off).
"""
import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from nanoandrea.config import get_preset  # noqa: E402
from torch_gpt import TorchGPT  # noqa: E402  (beside this file: Python puts its folder first)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="andrea-12m")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences a rank")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: a GPU a rank where there are GPUs")
    args = parser.parse_args()

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    config = get_preset(args.preset, vocab_size=args.vocab_size, block_size=args.block_size)
    model = DistributedDataParallel(TorchGPT(config, device=device),
                                    device_ids=[local] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    generator = torch.Generator().manual_seed(1 + rank)         # each rank its own shard
    shape = (args.batch_size, args.block_size)
    idx, targets = (torch.randint(0, args.vocab_size, shape, generator=generator).to(device)
                    for _ in range(2))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        return loss

    def synchronize():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    for _ in range(args.warmup):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    synchronize()
    seconds = time.perf_counter() - start
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    # (one write a line: the ranks share the terminal)
    sys.stdout.write(f"rank {rank}: parameters' sum {checksum:.10e}, "
                     f"last loss {float(loss.detach()):.4f}\n")
    sys.stdout.flush()
    if rank == 0:
        tokens = args.steps * args.batch_size * args.block_size * ranks
        print(f"PyTorch DDP, {ranks} ranks ({device.type}), {args.preset} B={args.batch_size} a "
              f"rank T={args.block_size} {args.precision}: {1e3 * seconds / args.steps:.1f} ms "
              f"a step, {tokens / seconds:,.0f} tokens/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
