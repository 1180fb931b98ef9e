"""Products whose 8-bit activations the node before them writes.

A decode product quantizes its activations to q8_1 blocks (in its planned scratch) before its
__dp4a kernel reads them: a launch of its own. Where the activations come straight from a kernel
that holds them in registers anyway (a residual add with its norm, decode attention, a fused gated
product), that kernel writes the q8_1 blocks too and the product skips its quantization launch.

The blocks go into one of a few fixed slots the backend owns (as ggml's CUDA backend takes its
quantized activations from its memory pool rather than from the graph's buffer): a producer's
blocks must survive from the producer to the product, which a product's scratch, planned for the
product alone, does not promise. Hand-offs whose producer-to-product spans overlap get different
slots; one that finds no free slot, or needs more than a slot holds, is not made.
"""
from __future__ import annotations

from typing import Callable

from ggrun.core.tensor import Tensor

PRODUCTS = ("mul_mat", "mul_mat_multi", "mul_mat_glu")
SLOTS = 4
SLOT_BYTES = 256 << 10
Q8_1_BYTES = 36  # one block of 32 activations: f16 scale and sum, 32 int8


def writes(producer: Tensor, act: Tensor) -> bool:
    """Whether act is the part of producer's result whose kernel can write it as q8_1 blocks too:
    the normed rows of add_rms_norm, the whole result of attention or of a gated product (rows of a
    multiple of 32 elements). The producer's binder still decides whether its kernel does."""
    if act.shape[-1] % 32 or not act.is_contiguous:
        return False
    if producer.op == "add_rms_norm":
        half = producer.srcs[0].n_elements
        return act.view_offset == half * 4 and act.n_elements == half
    if producer.op in ("flash_attn", "mul_mat_glu"):
        return act.view_offset == 0 and act.n_elements == producer.n_elements
    return False


class Handoffs:
    """Which producer writes which product's q8_1 activations, and in which slot, for one split.

    `reads_q8(product)` says whether a product's bound kernels would quantize its activations
    (few token rows, a __dp4a weight, contiguous rows). Producers are bound before their products:
    a producer's binder asks `dest(producer)` (a slot index) and reports `wrote(producer)` when its
    kernel writes the blocks; the product's binder then asks `fed(product)` for the slot to read.
    """

    def __init__(self, nodes: list[Tensor], reads_q8: Callable[[Tensor], bool]) -> None:
        self._slot_of: dict[Tensor, int] = {}  # producer -> slot
        self._product: dict[Tensor, Tensor] = {}  # producer -> product
        self._fed: dict[Tensor, int] = {}  # product -> slot its producer wrote
        self._at = at = {n: i for i, n in enumerate(nodes)}
        self._spans: list[list[tuple[int, int]]] = [[] for _ in range(SLOTS)]  # (producer, product) indices
        busy_until = [-1] * SLOTS  # node index of the product last reading each slot
        for i, product in enumerate(nodes):
            if product.op not in PRODUCTS or not reads_q8(product):
                continue
            act = product.srcs[-1]
            producer = act.root
            if producer not in at or producer in self._slot_of or not writes(producer, act):
                continue
            if act.n_elements // 32 * Q8_1_BYTES > SLOT_BYTES:
                continue
            free = [s for s in range(SLOTS) if busy_until[s] < at[producer]]
            if free:
                busy_until[free[0]] = i
                self._spans[free[0]].append((at[producer], i))
                self._slot_of[producer] = free[0]
                self._product[producer] = product

    def dest(self, producer: Tensor) -> int | None:
        """The slot the producer's kernel should write q8_1 blocks into, if any."""
        return self._slot_of.get(producer)

    def wrote(self, producer: Tensor) -> None:
        self._fed[self._product[producer]] = self._slot_of[producer]

    def fed(self, product: Tensor) -> int | None:
        """The slot holding the product's activations as q8_1 blocks, if its producer wrote them."""
        return self._fed.get(product)

    def idle(self, node: Tensor) -> int | None:
        """A slot no hand-off holds while `node` runs (none starts, ends or passes there): room for a fused
        kernel's own q8_1 activations that no planned result can overlap, where the planner may give the
        node's scratch, free once the node is done, to a later node the kernel writes too."""
        i = self._at.get(node)
        if i is None:
            return None
        return next((s for s in range(SLOTS) if all(not p <= i <= q for p, q in self._spans[s])), None)


NONE = Handoffs([], lambda _: False)
