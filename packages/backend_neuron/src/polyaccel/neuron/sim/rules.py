"""Trainium2 NeuronCore limits the interpreter enforces, and the error it raises.

Numbers are per NeuronCore-v3 (docs/neuron.md): the on-chip memories are laid out as 128
partitions; a tile's dim 0 is its partition axis and everything after it is free.
"""

from __future__ import annotations

NUM_PARTITIONS = 128
SBUF_BYTES_PER_PARTITION = 212_728  # of 224 KiB, what the NKI Library treats as usable
PSUM_BANK_BYTES = 2048  # one bank per partition: 512 fp32
PSUM_BANKS = 8  # 16 KiB per partition
MATMUL_MAX_K = 128  # contraction: the partition axis of both inputs
MATMUL_MAX_M = 128  # stationary free size
MATMUL_MAX_N = 512  # moving free size
PE_TRANSPOSE_MAX = 128  # nc_transpose on the Tensor Engine
VE_TRANSPOSE_MAX = 32  # nc_transpose on the Vector Engine


class NKIRuleError(RuntimeError):
    """A kernel broke a hardware rule; the message starts with the rule's name in brackets."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"[{rule}] {detail}")
        self.rule = rule
