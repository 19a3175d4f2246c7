"""torch.distributed.nn.functional.all_gather on gloo: its backward puts the right values in the wrong order when the
incoming gradient is not contiguous.

    python examples/repro_all_gather_backward_gloo.py

Two gloo ranks on 127.0.0.1 gather a (2, 3) tensor each along dim 1 and weight the result with a non-contiguous
tensor (the transpose of a contiguous one), as attention's backward hands an all-gather of keys the transposed
gradient of a product. The gradient each rank gets back must be W times its slice of the weights. torch's
differentiable all_gather (torch 2.13, gloo) returns those values in another order; the zoo's all_gather
(zoo/nn/collectives.py: the gradient made contiguous and reduce-scattered) returns them in place. A context-parallel
kernel built on torch's gets dK and dV wrong on the CPU: build the backward of every collective yourself, on
contiguous buffers (docs/distributed.md).

Prints one line per rank and function; exits 1 while torch's departure is there, 0 once it is gone.
"""
import datetime
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _rank(rank: int, port: int, results) -> None:
    from torch.distributed.nn.functional import all_gather as torch_all_gather
    from zoo.nn.collectives import all_gather as zoo_all_gather
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    gathers = {"torch.distributed.nn.functional.all_gather": lambda x: torch.cat(torch_all_gather(x), dim=1),
               "zoo.nn.collectives.all_gather": lambda x: zoo_all_gather(x, None, dim=1)}
    for name, gather in gathers.items():
        x = (torch.arange(6.0).reshape(2, 3) + 100 * rank).requires_grad_()
        y = gather(x)                                                        # (2, 3 W)
        weights = torch.arange(float(y.numel())).reshape(y.shape[::-1]).t()  # not contiguous
        (y * weights).sum().backward()
        want = WORLD * weights[:, 3 * rank:3 * (rank + 1)]
        results.put((rank, name, torch.equal(x.grad, want), x.grad.tolist(), want.tolist()))
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    ranks = [ctx.Process(target=_rank, args=(r, port, results), daemon=True) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
        if p.is_alive():
            p.kill()
    wrong = False
    for _ in range(2 * WORLD):
        rank, name, right, got, want = results.get()
        print(f"rank {rank} {name}: {'right' if right else f'WRONG: {got}, expected {want}'}")
        wrong |= not right and name.startswith("torch")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
