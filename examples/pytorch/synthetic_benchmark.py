"""Synthetic training throughput with bagua_hvd: Horovod's pytorch_synthetic_benchmark.py.

Same flags and output as Horovod's script, with models built from torch.nn only (no
torchvision) so that it runs anywhere, on CPU in seconds:

    bagua-run -np 2 python examples/pytorch/synthetic_benchmark.py
    bagua-run -np 2 python examples/pytorch/synthetic_benchmark.py --model mlp --fp16-allreduce

Each step runs forward, backward and optimizer.step() on one fixed random batch per rank;
hvd.DistributedOptimizer averages the gradients across ranks while backward() runs. After
--num-warmup-batches, --num-iters iterations of --num-batches-per-iter steps are timed; rank 0
prints the images/s of each iteration, their mean per rank (+- 1.96 standard deviations) and the
total over ranks.

Models (--model):
  resnet   a small ResNet (3 stages of 2 basic blocks, 32/64/128 channels, ~0.8M parameters)
  mlp      3 hidden layers of 1024 units with ReLU (~6.3M parameters)
Inputs are 3 x --image-size x --image-size images (default 32; Horovod's ImageNet models use
224) and --num-classes classes (default 1000, as in Horovod's script).
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import bagua_hvd.torch as hvd


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with batch norm, plus shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: one 3x3 stem, 3 stages of 2 basic blocks, global pooling."""

    def __init__(self, num_classes: int, widths: tuple[int, ...] = (32, 64, 128)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks, in_planes = [], widths[0]
        for i, planes in enumerate(widths):
            blocks += [
                BasicBlock(in_planes, planes, 1 if i == 0 else 2),
                BasicBlock(planes, planes),
            ]
            in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def mlp(num_classes: int, image_size: int, hidden: int = 1024, layers: int = 3) -> nn.Module:
    dims = [3 * image_size * image_size] + [hidden] * layers
    mods: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(dims, dims[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(dims[-1], num_classes))


MODELS = {
    "resnet": lambda args: ResNet(args.num_classes),
    "mlp": lambda args: mlp(args.num_classes, args.image_size),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="PyTorch Synthetic Benchmark",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--fp16-allreduce",
        action="store_true",
        default=False,
        help="use fp16 compression during allreduce",
    )
    parser.add_argument(
        "--model", type=str, default="resnet", choices=sorted(MODELS), help="model to benchmark"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument(
        "--num-warmup-batches",
        type=int,
        default=10,
        help="number of warm-up batches that don't count towards benchmark",
    )
    parser.add_argument(
        "--num-batches-per-iter",
        type=int,
        default=10,
        help="number of batches per benchmark iteration",
    )
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument(
        "--no-cuda", action="store_true", default=False, help="disables CUDA training"
    )
    parser.add_argument(
        "--use-adasum",
        action="store_true",
        default=False,
        help="use adasum algorithm to do reduction",
    )
    # Not in Horovod's script: the size of the synthetic images and the torch threads per rank.
    parser.add_argument("--image-size", type=int, default=32, help="height and width of inputs")
    parser.add_argument("--num-classes", type=int, default=1000, help="number of classes")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch threads per rank; 0: this host's cores divided by the ranks on it",
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "num_batches_per_iter", "num_iters", "image_size", "num_classes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("num_warmup_batches", "num_threads"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.backends.cudnn.benchmark = True

    # Set up the standard model.
    model = MODELS[args.model](args)
    # Horovod: scale the learning rate by the number of ranks (the global batch grows); Adasum
    # needs no scaling.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        # GPU Adasum averages within each host (Horovod's): scale the learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Set up fixed fake data.
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s: str, nl: bool = True) -> None:
        if hvd.rank() != 0:
            return
        print(s, end="\n" if nl else "", flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({n_params / 1e6:.2f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    device = "GPU" if args.cuda else "CPU"
    log(f"Number of {device}s: {hvd.size()}")
    log(f"Torch threads per rank: {threads}")

    # Warm-up
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    # Benchmark
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(
        f"Total img/sec on {hvd.size()} {device}(s): "
        f"{hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
