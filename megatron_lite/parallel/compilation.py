"""torch.compile, and the functions it must leave eager, without importing torch._dynamo at start-up.

`torch.compiler.disable` imports torch._dynamo where it decorates: 0.7 s of every process's start-up, though only a
run that compiles (--torch-compile, FlexAttention on CUDA) ever traces a graph. `eager` marks a function to be left
out of compiled graphs; `compile` first hands every marked function to torch.compiler.disable, then compiles, so a
graph breaks around each of them exactly as around a function decorated with torch.compiler.disable.
"""

from __future__ import annotations

import functools

import torch

_MARKED: list = []
_compiled_once = False


def eager(function):
    """`function`, run eagerly inside whatever `compile` compiles."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        return call.implementation(*args, **kwargs)

    call.implementation = torch.compiler.disable(function) if _compiled_once else function
    _MARKED.append(call)
    return call


def compile(target, **options):  # noqa: A001 - torch.compile's name, which it stands for
    """torch.compile(target, **options), with the functions marked `eager` left out of its graphs."""
    global _compiled_once
    if not _compiled_once:
        for call in _MARKED:
            call.implementation = torch.compiler.disable(call.__wrapped__)
        _compiled_once = True
    return torch.compile(target, **options)
