"""Synthetic tasks generated on the fly from a seed: nothing to download, endless fresh examples.

    copy         x -> x
    reverse      x -> x reversed
    sort         x -> x sorted (repeats kept)
    running_max  x -> one label per token: 1 if it is larger than every token before it (encoder-only)

Token ids: 0..3 are reserved and the task's symbols 0..vocab-1 are ids 4..vocab+3.

    PAD = 0  padding (masked out, never a loss target)
    BOS = 1  begins a decoder-only sequence and every encoder-decoder target
    SEP = 2  ends a decoder-only prompt: the answer follows it
    EOS = 3  ends every answer (the model must learn when to stop)

Layouts (n = length of x; sequences are right-padded with PAD):

    decoder_only     tokens  BOS x_1..x_n SEP y_1..y_n EOS   (inputs = all but the last, targets = all but the
                     first; the loss covers only the answer y_1..y_n EOS, never the prompt)
    encoder_decoder  src x_1..x_n;  tgt BOS y_1..y_n;  targets y_1..y_n EOS
    encoder_only     tokens x_1..x_n;  targets the 0/1 labels

Packing (``task.packing=true``, decoder_only): ``pack`` lays the sequences of a batch end to end into rows of
the model's length (varlen semantics: ``segments`` says which sequence each token belongs to, and the model
attends within each and restarts positions, zoo.nn.packing.Packing), so the same target tokens cost fewer
padded positions and the loss is that of the unpacked batch.

A batch is a function of (seed, stream, index) alone: training batch i is the same whether or not the
run was interrupted, and the held-out stream never shares a generator with the training one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from zoo.config.options import DATA_TASKS, LABEL_TASKS, SEQUENCE_TASKS

__all__ = ["PAD", "BOS", "SEP", "EOS", "N_SPECIAL", "IGNORE",
           "FAMILY_TASKS", "SyntheticTask", "task_from_config", "stream_seed", "symbols_to_text", "pack"]

PAD, BOS, SEP, EOS = 0, 1, 2, 3
N_SPECIAL = 4
IGNORE = -100  # target value that F.cross_entropy(ignore_index=-100) skips
FAMILY_TASKS = {"decoder_only": SEQUENCE_TASKS, "encoder_decoder": SEQUENCE_TASKS, "encoder_only": LABEL_TASKS}
_SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", SEP: "<sep>", EOS: "<eos>"}


def stream_seed(seed: int, stream: str, index: int = 0) -> int:
    """A 63-bit seed for one (seed, stream, index): streams never collide the way seed + k offsets can."""
    digest = hashlib.sha256(f"{seed}/{stream}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def symbols_to_text(ids) -> str:
    """Token ids as the user reads them: symbols as 0-based numbers, reserved ids by name, padding dropped."""
    return " ".join(_SPECIAL_NAMES[i] if i < N_SPECIAL else str(i - N_SPECIAL) for i in map(int, ids) if i != PAD)


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    vocab: int = 16     # number of symbols
    min_len: int = 8
    max_len: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.name not in DATA_TASKS:
            raise ValueError(f"unknown task {self.name!r} (allowed: {', '.join(DATA_TASKS)})")
        if self.vocab < 1 or not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need vocab >= 1 and 1 <= min_len <= max_len, got vocab={self.vocab}, "
                             f"min_len={self.min_len}, max_len={self.max_len}")

    # ------------------------------------------------------------------ what the model must be able to hold
    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + self.vocab

    def model_max_len(self, family: str) -> int:
        """Positions the model sees: the longest input of the family's layout."""
        self.check_family(family)
        if family == "decoder_only":
            return 2 * self.max_len + 2  # BOS x SEP y (the final EOS is only a target)
        if family == "encoder_decoder":
            return self.max_len + 1      # BOS y on the decoder side; the source is shorter
        return self.max_len

    def check_family(self, family: str) -> None:
        if self.name not in FAMILY_TASKS[family]:
            raise ValueError(f"data={self.name} does not fit model={family} "
                             f"(allowed for {family}: {', '.join(FAMILY_TASKS[family])})")

    # ------------------------------------------------------------------ examples
    def sample(self, n: int, stream: str = "train", index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """n sequences of symbol ids (already offset by N_SPECIAL), right-padded: (x (n, max_len), lengths (n,))."""
        generator = torch.Generator().manual_seed(stream_seed(self.seed, stream, index))
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator)
        x = torch.randint(N_SPECIAL, N_SPECIAL + self.vocab, (n, self.max_len), generator=generator)
        return x.masked_fill(~_real(lengths, self.max_len), PAD), lengths

    def answer(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The target for each sequence: right-padded symbols, or 0/1 labels with IGNORE on padding."""
        real = _real(lengths, x.shape[1])
        if self.name == "copy":
            return x.clone()
        if self.name == "reverse":
            index = (lengths[:, None] - 1 - torch.arange(x.shape[1])).clamp(min=0)
            return torch.gather(x, 1, index).masked_fill(~real, PAD)
        if self.name == "sort":
            # Padding sorts last when it counts as larger than every symbol.
            big = N_SPECIAL + self.vocab
            return x.masked_fill(~real, big).sort(dim=1).values.masked_fill(~real, PAD)
        # running_max: x_i > max(x_1..x_{i-1}); the first token is larger than the empty prefix.
        before = torch.cat([torch.full_like(x[:, :1], -1), x[:, :-1].cummax(dim=1).values], dim=1)
        return (x > before).long().masked_fill(~real, IGNORE)

    def batch(self, family: str, n: int, stream: str = "train", index: int = 0) -> dict[str, torch.Tensor]:
        """One batch in the family's layout (see the module docstring), on the CPU."""
        self.check_family(family)
        x, lengths = self.sample(n, stream, index)
        y = self.answer(x, lengths)
        if family == "encoder_only":
            return {"tokens": x, "mask": _real(lengths, self.max_len), "targets": y, "lengths": lengths}
        # Answer followed by EOS, padded one wider so that the EOS of a full-length row fits.
        answer = torch.cat([y, torch.full_like(y[:, :1], PAD)], dim=1)
        answer.scatter_(1, lengths[:, None], EOS)
        if family == "encoder_decoder":
            tgt = torch.cat([torch.full_like(y[:, :1], BOS), y], dim=1)
            targets = answer.masked_fill(answer == PAD, IGNORE)
            return {"src": x, "src_mask": _real(lengths, self.max_len), "tgt": tgt,
                    "tgt_mask": _real(lengths + 1, self.max_len + 1), "targets": targets, "lengths": lengths}
        # decoder_only: BOS x SEP answer, built by scattering each piece to its positions.
        width = 2 * self.max_len + 3
        seq = torch.full((n, width + 1), PAD, dtype=torch.long)  # one spare column collects padding writes
        column = torch.arange(self.max_len)
        real = _real(lengths, self.max_len)
        seq[:, 0] = BOS
        seq.scatter_(1, torch.where(real, 1 + column, width), x)
        seq.scatter_(1, 1 + lengths[:, None], SEP)
        seq.scatter_(1, torch.where(_real(lengths + 1, self.max_len + 1), 2 + lengths[:, None] +
                                    torch.arange(self.max_len + 1), width), answer)
        seq = seq[:, :width]
        targets = seq[:, 1:].clone()
        position = torch.arange(1, width)
        in_answer = position >= (lengths[:, None] + 2)  # targets at seq positions n+2 .. 2n+2
        targets = targets.masked_fill(~in_answer | (targets == PAD), IGNORE)
        return {"tokens": seq[:, :-1], "targets": targets, "lengths": lengths}


def pack(batch: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """A decoder_only batch with its sequences packed end to end into rows of ``width`` positions, in order,
    a new row when the next sequence does not fit (next fit). Each sequence keeps its inputs BOS x SEP y
    (2n + 2 tokens; the final EOS is only a target) and their targets; ``segments`` (rows, width) numbers the
    sequences of each row from 0, -1 on the padding after them. Rows vary in number, the target tokens not."""
    used = 2 * batch["lengths"] + 2
    if int(used.max()) > width:
        raise ValueError(f"a sequence of {int(used.max())} positions does not fit rows of {width}")
    rows: list[list[int]] = []
    filled = 0
    for k, n in enumerate(used.tolist()):
        if not rows or filled + n > width:
            rows.append([])
            filled = 0
        rows[-1].append(k)
        filled += n
    tokens = torch.full((len(rows), width), PAD, dtype=batch["tokens"].dtype)
    targets = torch.full((len(rows), width), IGNORE, dtype=batch["targets"].dtype)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for index, k in enumerate(members):
            n = int(used[k])
            tokens[r, at:at + n] = batch["tokens"][k, :n]
            targets[r, at:at + n] = batch["targets"][k, :n]
            segments[r, at:at + n] = index
            at += n
    return {"tokens": tokens, "targets": targets, "segments": segments, "lengths": batch["lengths"]}


def _real(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width) < lengths[:, None]


def task_from_config(node) -> SyntheticTask:
    return SyntheticTask(name=node.name, vocab=node.vocab, min_len=node.min_len, max_len=node.max_len,
                         seed=node.seed)
