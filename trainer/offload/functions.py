"""The autograd functions through which the engine sees the backward pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class PostBackward(torch.autograd.Function):
    """Identity on a block's inputs; its backward runs once the gradient of those inputs is complete,
    that is once every kernel of the block's backward that reads the block's weights is queued."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.callback()
        return (None, *grads)


class GatheredRows(torch.autograd.Function):
    """Embedding rows gathered on the CPU and shipped to the device; the gradient of the rows goes
    back to the engine (which adds it into the embedding's gradient on the CPU), not to `anchor`.

    `anchor` is the embedding's parameter: it only makes the rows require grad when it does.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, gather: Callable[[], torch.Tensor],
                on_grad: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.on_grad = on_grad
        return gather()

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[None, None, None]:
        ctx.on_grad(grad_rows)
        return None, None, None


class StreamedLinear(torch.autograd.Function):
    """y = x W^T with W streamed to the device in row chunks, in forward and again in backward.

    The gradient of W goes to the engine chunk by chunk (so it never exists whole on the device);
    `anchor` is W's parameter and only makes the output require grad when W does.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, streamer: ChunkedLinear) -> torch.Tensor:
        ctx.streamer = streamer
        ctx.save_for_backward(x)
        return streamer.forward(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (x,) = ctx.saved_tensors
        grad_input = ctx.streamer.backward(x, grad_output, input_needs_grad=ctx.needs_input_grad[0])
        return grad_input, None, None


class ChunkedLinear(Protocol):
    """What StreamedLinear runs: the forward and backward of y = x W^T with W streamed."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def backward(self, hidden: torch.Tensor, grad_output: torch.Tensor, *,
                 input_needs_grad: bool) -> torch.Tensor | None: ...


# torch.autograd.Function.apply is unannotated: these give the engine typed calls.
def post_backward(callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    result: tuple[torch.Tensor, ...] = PostBackward.apply(callback, *inputs)  # type: ignore[no-untyped-call]
    return result


def gathered_rows(anchor: torch.Tensor, gather: Callable[[], torch.Tensor],
                  on_grad: Callable[[torch.Tensor], None]) -> torch.Tensor:
    result: torch.Tensor = GatheredRows.apply(anchor, gather, on_grad)  # type: ignore[no-untyped-call]
    return result


def streamed_linear(x: torch.Tensor, anchor: torch.Tensor, streamer: ChunkedLinear) -> torch.Tensor:
    result: torch.Tensor = StreamedLinear.apply(x, anchor, streamer)  # type: ignore[no-untyped-call]
    return result
