"""Features through a 1-d convolution of grouped channels, as the block trace follows them.

A 1-d convolution over time with ``groups`` > 1 mixes the channels only within each group: output channel o of
group g reads the input channels of group g, at a few positions in time. A depthwise convolution (one filter
per channel: LFM2's short convolution, Mamba's ``conv1d``) is the case of one input channel per group;
ZAYA's grouped convolution over ``[q | k]``, one group per head, mixes the features of one head. So output
channel o carries the features of its group's input channels, one shadow slot per input channel of a group,
and its filter (weight row o, bias o) splits with them: rank r keeps the output channels whose features it
keeps. A convolution with one group mixes every channel: its features are not followed.

Padding before the convolution (``F.pad`` of the time dimension, a causal convolution's left context) holds no
feature, so a channel's features are read at the positions that hold one.
"""

from __future__ import annotations

import torch
from torch import Tensor


def channel_features(shadow: Tensor) -> Tensor | None:
    """The feature each channel of a ``(batch, channels, time)`` shadow holds, ``(batch, channels)``: the one it
    holds at every position that holds one (-1: none); None if a channel holds different ones over time."""
    top = shadow.max(-1).values
    low = shadow.masked_fill(shadow < 0, shadow.max() + 1).min(-1).values
    low = low.masked_fill(top < 0, -1)
    return top if bool((top == low).all()) else None


def grouped_slots(shadow: Tensor, groups: int, out_shape) -> list[Tensor] | None:
    """The shadow slots of a grouped convolution's output (``out_shape``: batch, channels, time) from one slot of
    its input's: slot j holds, at output channel o, the feature of the j-th input channel of o's group."""
    channels = channel_features(shadow)
    if channels is None:
        return None
    per_group_in, per_group_out = shadow.shape[1] // groups, out_shape[1] // groups
    group = torch.arange(out_shape[1], device=shadow.device) // per_group_out  # output channel -> its group
    return [channels[:, group * per_group_in + j].unsqueeze(-1).expand(out_shape).clone() for j in range(per_group_in)]
