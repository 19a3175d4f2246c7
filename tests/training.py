"""What the training and generation tests share: a tiny config per family and its data task."""
from __future__ import annotations

import hashlib
from pathlib import Path

from zoo.config.composition import compose_config

TINY = ["d_model=32", "heads=2", "layers=1", "d_ff=64", "norm_placement=pre", "pos=learned",
        "data.vocab=6", "data.min_len=2", "data.max_len=5"]
DATA_FOR = {"decoder_only": "reverse", "encoder_decoder": "sort", "encoder_only": "running_max"}


def train_config(out_dir, *extra, family="decoder_only", data=None):
    return compose_config([f"model={family}", "task=train", f"data={data or DATA_FOR[family]}", *TINY,
                           f"task.out_dir='{out_dir}'", "task.batch=16", "task.eval_batches=2",
                           "task.warmup=5", "task.lr=3e-3", *extra])


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
