"""The bf16 + int16 remainder encoding of an fp32 value (Transformer Engine's rule).

An fp32 bit pattern is cut into its high and low 16 bits; the low half is kept as int16 and,
when it is negative as int16 (low bits >= 0x8000), the high half is incremented: rounding half
up in magnitude, since IEEE floats are sign-magnitude. Every remainder then fits int16 and the
round trip is exact for every finite fp32 value. Megatron-Core's ``store_param_remainders``
stores fp32 master weights this way: the bf16 model param is the high half.
"""

from __future__ import annotations

import torch

__all__ = [
    "join_bf16_remainder",
    "round_half_up_to_bf16",
    "split_fp32",
    "split_fp32_into_",
]


def split_fp32(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut fp32 values into a bf16 high half (rounded half up in magnitude) and an int16 remainder.

    The remainder is the low 16 bits read as a signed int16. Where it is negative (low bits
    ``>= 0x8000``) the high half is incremented by one, which, IEEE floats being sign-magnitude,
    moves it one bf16 ulp away from zero: round to nearest with ties away from zero. This is
    TE's ``multi_tensor_adam_param_remainder`` rule; :func:`join_bf16_remainder` undoes it exactly.

    Edge cases, all pinned by tests: the largest finite fp32 values (``|x| >= 0x7F7F8000`` as bits,
    halfway past the largest bf16) get an infinite high half while the pair still joins back to
    the finite master. A NaN whose high half is ``0x7FFF`` or ``0xFFFF`` with low bits
    ``>= 0x8000`` wraps (as in TE's int16 arithmetic) to a high half of ``-0.0`` or ``+0.0``;
    the pair still joins back to the NaN. Arithmetic NaNs (``0x7FC00000``, ``0xFFC00000``) have
    zero low bits and keep a NaN high half.

    Args:
        master: float32 values, any shape.

    Returns:
        ``(high, remainder)``: bfloat16 and int16 tensors of ``master``'s shape.

    Raises:
        TypeError: ``master`` is not float32.

    Example:
        >>> high, remainder = split_fp32(torch.tensor([1.0, -2.5]))
        >>> high.tolist(), remainder.tolist()
        ([1.0, -2.5], [0, 0])
        >>> bits = torch.tensor([0x3F808000], dtype=torch.int32)  # 1.0 + 2**-8, a bf16 tie
        >>> high, remainder = split_fp32(bits.view(torch.float32))
        >>> high.item(), remainder.item()  # rounded up (torch's .to(bfloat16) gives the even 1.0)
        (1.0078125, -32768)
    """
    if master.dtype != torch.float32:
        raise TypeError(f"`master`: split_fp32 cuts float32 bit patterns; got {master.dtype}; expected torch.float32")
    high = torch.empty_like(master, dtype=torch.bfloat16)
    remainder = torch.empty_like(master, dtype=torch.int16)
    split_fp32_into_(master, high, remainder)
    return high, remainder


def split_fp32_into_(master: torch.Tensor, high: torch.Tensor, remainder: torch.Tensor) -> None:
    """:func:`split_fp32` written into existing ``high`` (bf16) and ``remainder`` (int16) tensors.

    Same values, bit for bit, without fp32-sized temporaries beyond one int32 tensor: the
    precision-aware optimizer writes the model param and its stored remainder this way.

    Args:
        master: float32 values (not checked: :func:`split_fp32` is the checked entry point).
        high: bfloat16 tensor of ``master``'s shape, overwritten with the high halves.
        remainder: int16 tensor of ``master``'s shape, overwritten with the remainders.
    """
    bits = master.view(torch.int32)
    # Converting int32 to int16 keeps the low 16 bits (two's complement), i.e. the signed remainder.
    remainder.copy_(bits)
    # high + carry, where carry is bit 15 (low bits >= 0x8000): ((bits >> 15) + 1) >> 1, all in
    # int32 with arithmetic shifts (no overflow: bits >> 15 < 2**16). It reaches 2**15 only for
    # the NaNs above, where the int32 -> int16 copy wraps, as .to does.
    carried = bits >> 15
    carried.add_(1).bitwise_right_shift_(1)
    high.view(torch.int16).copy_(carried)


def join_bf16_remainder(high: torch.Tensor, remainder: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values that :func:`split_fp32` cut into ``(high, remainder)``: exact inverse.

    ``bits = (high << 16) + remainder`` with both halves sign-extended: adding a negative
    remainder borrows the one that the split carried into the high half.

    Args:
        high: bfloat16 high halves (the model params when remainders are stored).
        remainder: int16 remainders, same shape.
        out: an int32 tensor of ``high``'s shape and layout to write the bits into (a buffer
            kept between calls); default: a new one.

    Returns:
        A float32 tensor (``out`` viewed as float32, when given).

    Raises:
        TypeError: a dtype is not bfloat16 / int16 / int32 (``out``).
        ValueError: the shapes differ.

    Example:
        >>> master = torch.tensor([3.14159265, -1e-30, 3.0e38])
        >>> torch.equal(join_bf16_remainder(*split_fp32(master)), master)
        True
    """
    if high.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(
            f"`high, remainder`: join_bf16_remainder takes the halves split_fp32 returns; "
            f"got ({high.dtype}, {remainder.dtype}); expected (torch.bfloat16, torch.int16)"
        )
    if high.shape != remainder.shape:
        raise ValueError(
            f"`remainder`: shape differs from the high half's; got {tuple(remainder.shape)}; "
            f"expected {tuple(high.shape)}"
        )
    if out is not None and (out.dtype != torch.int32 or out.shape != high.shape):
        raise (TypeError if out.dtype != torch.int32 else ValueError)(
            f"`out`: must be an int32 tensor of the halves' shape; got {out.dtype} of shape {tuple(out.shape)}; "
            f"expected torch.int32 of shape {tuple(high.shape)}"
        )
    # high << 16 lies in [-2**31, 2**31 - 2**16]; the sum overflows int32 only for the wrapped
    # NaNs documented in split_fp32, where two's complement wrap-around restores their bits.
    # All in place in one int32 tensor: temporaries cost more here than the arithmetic.
    bits = out if out is not None else torch.empty_like(high, dtype=torch.int32)
    bits.copy_(high.view(torch.int16)).bitwise_left_shift_(16).add_(remainder)
    return bits.view(torch.float32)


def round_half_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16, to nearest with ties away from zero: the high half :func:`split_fp32` keeps.

    It equals torch's ``x.to(torch.bfloat16)`` (ties to even) except on exact ties (low 16 bits
    ``== 0x8000``) whose truncated high half is even: there it is one bf16 ulp further from zero.

    Example:
        >>> tie = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)
        >>> round_half_up_to_bf16(tie).item(), tie.to(torch.bfloat16).item()
        (1.0078125, 1.0)
    """
    return split_fp32(x)[0]
