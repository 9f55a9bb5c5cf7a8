"""The metadata every attention call of a step reads, and the paged KV layout it describes.

KV layout, per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``.

- ``slot_mapping[t] = block_id * block_size + offset`` for each new token; -1 means "do not
  store" (padded rows).
- ``block_tables``: int32 ``[num_seqs, max_blocks]``, padded with 0 past a sequence's blocks.
- ``seq_lens``: int32, the context length including this step's new tokens (K/V is stored
  first, then attended).
- GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
- Prefill: query ``j`` of a sequence with ``q_len`` new tokens sits at position
  ``seq_len - q_len + j`` and attends to positions ``<= seq_len - q_len + j``.
- Every attention entry point takes an optional ``out=`` tensor; relative error means
  ``|out - ref| / |ref|`` over the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference.device import tensor_from_host


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one engine step; passed explicitly to every layer (a
    runner fills it from its persistent input buffers; ``build`` makes one from lists)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot per new token, -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's new tokens
    # host copies, so the CPU path never syncs on device tensors
    seq_lens_list: list[int]
    query_lens_list: list[int]
    num_blocks_list: list[int]
    is_decode_list: list[bool]  # True: the sequence's one new token is a decode token
    # the block tables on the host (a CPU tensor; ``block_tables`` itself on the CPU), so
    # plans built from them never wait for the device
    block_tables_host: torch.Tensor | None = None
    # per-step index work shared by all layers (decode gather rows per sequence)
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def host_block_tables(self) -> torch.Tensor:
        """The block tables as a CPU tensor (no device sync where the runner kept a copy)."""
        if self.block_tables_host is not None:
            return self.block_tables_host
        return self.block_tables.cpu()

    def to_device(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A host list as a tensor on the step's device, without waiting for the device
        (``device.tensor_from_host``)."""
        return tensor_from_host(values, dtype, self.slot_mapping.device)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        is_decode: list[bool] | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are new.

        ``is_decode[i]`` marks a decode token (default: none; every chunk is a prompt chunk).
        """
        slots: list[int] = []
        for table, sl, ql in zip(block_tables, seq_lens, query_lens, strict=True):
            for pos in range(sl - ql, sl):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        cu = [0]
        for ql in query_lens:
            cu.append(cu[-1] + ql)
        host_tables = torch.tensor(padded, dtype=torch.int32).reshape(len(block_tables), max_blocks)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=host_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens_list=list(seq_lens),
            query_lens_list=list(query_lens),
            num_blocks_list=[-(-sl // block_size) for sl in seq_lens],
            is_decode_list=list(is_decode) if is_decode is not None else [False] * len(seq_lens),
            block_tables_host=host_tables,
        )
